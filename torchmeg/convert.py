"""`python -m torchmeg.convert`: torchmeg.checkpoint.convert (--help says more)."""
from torchmeg.checkpoint.convert import main
from torchmeg.runtime.guard import exit_now

if __name__ == "__main__":
    exit_now(main())
