"""`python -m torchmeg.eval`: torchmeg.inference.evaluate (--help says more)."""
from torchmeg.inference.evaluate import main
from torchmeg.runtime.guard import exit_now

if __name__ == "__main__":
    exit_now(main())
