"""`python -m torchmeg.train` / `torchrun -m torchmeg.train`: torchmeg.train.cli (--help says more)."""
from torchmeg.runtime import omp_spin

omp_spin.apply()  # (before torch is imported: libgomp reads its spin count when it loads)

from torchmeg.runtime.guard import exit_now  # noqa: E402
from torchmeg.train.cli import main  # noqa: E402

if __name__ == "__main__":
    exit_now(main())
