"""`python -m torchmeg.launch`: torchmeg.runtime.launch (torchrun with one-line failures)."""
import sys

from torchmeg.runtime.launch import main

if __name__ == "__main__":
    sys.exit(main())
