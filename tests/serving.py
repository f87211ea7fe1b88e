"""A real `python -m torchmeg.serve` process for the serving tests (tests/test_serve.py, its lifecycle in
tests/test_serve_lifecycle.py, a converted release's in tests/test_release_generation.py), reached with the
official `openai` client or raw HTTP."""
import http.client
import os
import shutil
import signal
import sys
import tempfile
import time

import openai

from launch import free_port, start

PROMPTS = ["def fibonacci(n):", "import os", "class Parser:\n    def __init__(self, text"]
SAMPLED = dict(temperature=0.9, top_p=0.9, seed=3)


class Server:
    """`python -m torchmeg.serve` on the debug run's checkpoint, on nproc ranks (rank 0 answers)."""

    def __init__(self, run_dir, extra=(), nproc=1, recipe=None, rank_env=None):
        """recipe: serve that recipe (a converted release's) as it stands instead of the debug run;
        rank_env: {rank: more environment} (test hooks for one rank)."""
        self.port, self.logs = free_port(), tempfile.mkdtemp(prefix="torchmeg-serve-")
        what = ["--config", str(recipe)] if recipe else [
            "--config", "recipes/debug_llama.toml", f"--job.dump_folder={run_dir}", "--job.name=debug",
            "--data.chat_template=chatml"]
        cmd = [sys.executable, "-m", "torchmeg.serve", *what, "--port", str(self.port)] + list(extra)
        env, master = dict(os.environ, PYTHONUNBUFFERED="1"), str(free_port())
        self.procs = []
        for r in range(nproc):
            e = env if nproc == 1 else dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc),
                                            LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                                            MASTER_PORT=master, OMP_NUM_THREADS="1", **(rank_env or {}).get(r, {}))
            self.procs.append(start(cmd, e, os.path.join(self.logs, f"{r}.out"), os.path.join(self.logs, f"{r}.err")))
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.time() + 90
        while True:
            try:
                if self.request("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if any(p.poll() is not None for p in self.procs) or time.time() > deadline:
                log = self.log()  # (read before kill, which removes the folder: a failure once said nothing)
                self.kill()
                raise AssertionError(f"the server did not start:\n{log}")
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def log(self) -> str:
        return "\n".join(open(os.path.join(self.logs, f)).read()[-3000:] for f in sorted(os.listdir(self.logs)))

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, str]:
        """A raw HTTP request (what a client other than openai's may send) -> (status, body text)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            c.request(method, path, body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            return r.status, r.read().decode()
        finally:
            c.close()

    def metrics(self) -> dict:
        text = self.request("GET", "/metrics")[1]
        return {k: float(v) for k, v in (line.split() for line in text.splitlines() if not line.startswith("#"))}

    def stop(self, timeout=60) -> list[int]:
        """SIGTERM to rank 0 (it drains, then tells the others) -> every rank's exit code."""
        os.kill(self.procs[0].pid, signal.SIGTERM)
        try:
            return [p.wait(timeout) for p in self.procs]
        finally:
            self.kill()

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.logs, ignore_errors=True)


def _complete(client, prompt, max_tokens, stream=False, **kw):
    """-> (text, finish_reason, completion tokens or None when streamed)."""
    sampling = dict(temperature=kw.get("temperature", 0.0), max_tokens=max_tokens, seed=kw.get("seed"),
                    top_p=kw.get("top_p", 1.0))
    if stream:
        parts = list(client.completions.create(model="debug", prompt=prompt, stream=True, **sampling))
        return "".join(c.choices[0].text for c in parts), parts[-1].choices[0].finish_reason, None
    r = client.completions.create(model="debug", prompt=prompt, **sampling)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
