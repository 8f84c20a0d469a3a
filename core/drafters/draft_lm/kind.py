"""The draft LM's engine half: its row of the kind table. A draft LM is any causal LM sharing the target's
tokenizer (an exported ``draft_lm`` or a plain HF directory), so it has no loader here: the engine runs it on a
runner of its own (``inference.drafters.load_draft_lm``)."""

from __future__ import annotations

from core.drafters.kinds import EngineKind, register_engine_kind

DRAFT_LM = register_engine_kind(
    EngineKind(
        name="draft_lm",
        title="draft LM",
        needs="a draft LM (an exported draft_lm or a HF directory sharing the target's tokenizer)",
    )
)
