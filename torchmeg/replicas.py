"""`python -m torchmeg.replicas`: torchmeg.runtime.replicas (the lighthouse and N replica groups, torchft)."""
import sys

from torchmeg.runtime.replicas import main

if __name__ == "__main__":
    sys.exit(main())
