"""`python -m torchmeg.serve`: torchmeg.serving.cli (--help says more)."""
from torchmeg.runtime.guard import exit_now
from torchmeg.serving.cli import main

if __name__ == "__main__":
    exit_now(main())
