"""python -m torchmeg.launch [torchrun's arguments] -m torchmeg.train --config RECIPE [...]

torchrun (torch.distributed.run, the same arguments), with what a multi-node torchmeg job wants:

* A rendezvous that does not complete (a node that never starts, or cannot reach the endpoint)
  ends at its join timeout (`--rdzv-conf join_timeout=S`, torch's default 600 s) with one line
  naming the rendezvous and what to check, exit 2, instead of a traceback.
* A job whose workers failed ends with one line after the workers' own (each failing rank has
  printed its error, tagged with its rank), exit 1.
* Nodes can be replaced: a node that died and is started again joins the next rendezvous round.
  torch 2.13 shares the rendezvous TCPStore with the workers by default, and a new agent then waits
  for a bootstrap address no one republishes; so torchmeg.launch sets
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (each round's rank 0 worker hosts a fresh store) unless it
  is set already.
* The workers' MASTER_PORT, which rank 0 binds after its imports, is drawn below the kernel's ephemeral
  range (torchmeg.runtime.ports), not by torch's bind to port 0: an outgoing connection cannot take it
  in between.

Two nodes over loopback (what tests/test_multinode.py runs):
    python -m torchmeg.launch --nnodes=2 --nproc_per_node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=job1 --max-restarts=1 -m torchmeg.train --config R
"""
from __future__ import annotations

import logging
import os
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous import api as rendezvous_api
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

from torchmeg.runtime.ports import unused_port

PROG = "torchmeg.launch"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The workers' MASTER_PORT: torch's rendezvous picks it with get_free_port (a bind to port 0, from the
    # ephemeral range), which rank 0's worker binds seconds later; ours is drawn below that range.
    rendezvous_api.get_free_port = unused_port
    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        torchrun.run(args)
        return 0
    except (RendezvousTimeoutError, RendezvousClosedError) as e:
        logging.shutdown()
        print(f"{PROG}: error: rendezvous {args.rdzv_id!r} at {args.rdzv_endpoint} ({args.rdzv_backend}) did not "
              f"complete with --nnodes={args.nnodes}: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}; "
              f"check that every node started with the same --rdzv-id and --rdzv-endpoint and can reach it "
              f"(the wait is --rdzv-conf join_timeout=SECONDS)", file=sys.stderr, flush=True)
        return 2
    except ChildFailedError as e:
        first = min(e.failures.items(), key=lambda kv: kv[1].timestamp) if e.failures else None
        what = f"first rank {first[0]} (exit code {first[1].exitcode})" if first else "no failure recorded"
        print(f"{PROG}: error: {len(e.failures)} worker(s) failed, {what}; their own lines above say why",
              file=sys.stderr, flush=True)
        return 1
