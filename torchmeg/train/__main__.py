"""`python -m torchmeg.train` / `torchrun -m torchmeg.train`: torchmeg.train.cli (--help says more)."""
from torchmeg.runtime.guard import exit_now
from torchmeg.train.cli import main

if __name__ == "__main__":
    exit_now(main())
