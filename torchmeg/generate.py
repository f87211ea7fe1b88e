"""`python -m torchmeg.generate`: torchmeg.inference.generate (--help says more)."""
from torchmeg.inference.generate import main
from torchmeg.runtime.guard import exit_now

if __name__ == "__main__":
    exit_now(main())
