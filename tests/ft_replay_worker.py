"""Worker for tests/test_fault_tolerance.py: the reference a fault-tolerant run is judged by, replayed
from its logged membership on ONE process. Committed step s with P_s groups taking part trained the P_s
group batches from the data cursor on; here one process trains them as one batch (the same samples,
the same mean over targets: every position is a target in these runs), with the same LR schedule.

    python tests/ft_replay_worker.py MEMBERSHIP_JSON GROUP_RANKS -- TRAIN_ARGS...
    (MEMBERSHIP_JSON: [P_1, P_2, ...]; GROUP_RANKS: ranks per group; prints one JSON line of
     [{"step", "loss", "grad_norm"}, ...])
"""
import json
import sys


def main():
    members, group_ranks = json.loads(sys.argv[1]), int(sys.argv[2])
    train_args = sys.argv[sys.argv.index("--") + 1:]
    from torchmeg.runtime import process as runtime
    from torchmeg.train.fault_tolerance import step_batches
    from torchmeg.train.cli import parse_args
    from torchmeg.train.trainer import Trainer

    cfg = parse_args(train_args)
    trainer = Trainer(cfg)  # one process, no fault tolerance: the plain trainer
    local = cfg.training.local_batch_size
    group_batch = local * group_ranks  # (accum 1)
    cursor, rows = 0, []
    for step, p in enumerate(members, start=1):
        batches = step_batches(trainer.train_set, p * group_batch, 1, 0, 1, cursor, 1, 0)
        loss, gn, stepped = trainer.train_step(batches)
        assert stepped, f"step {step} did not step"
        trainer.state.step = step
        cursor += p * group_batch
        rows.append({"step": step, "loss": loss, "grad_norm": gn})
    print(json.dumps(rows), flush=True)
    trainer.close()
    runtime.finish_script()


if __name__ == "__main__":
    main()
