"""``python -m inference.serve target=smollm2 drafters=DIR algorithm=eagle3_tree host=127.0.0.1 port=8000``."""

import sys

from inference.serve.server import main

if __name__ == "__main__":
    sys.exit(main())
