"""`make serve`'s console: one line per stage of bringing kvrelay up (install, model preparation, Ray, each engine,
the start-up calibration, ready), each with the seconds since it began, instead of pip's, vLLM's and Ray's output.

That output goes to files: pip's and the model preparation's under `.data/logs/`, `serve run`'s console to
`.data/logs/serve_run.log`, and every Ray process's (vLLM's engines included) to Ray's session log folder, named on
the Ray line. Standard library only: it runs before the virtual environment exists.

    python3 -m app.serve_progress serve_config.yaml [--url http://127.0.0.1:8000]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = REPO_ROOT / ".data" / "logs"
SERVE = REPO_ROOT / ".venv" / "bin" / "serve"
# What `serve run` prints once its Ray instance is up (ray/_private/worker.py).
RAY_UP = (b"Started a local Ray instance", b"Connected to Ray cluster")
POLL_S = 0.5


class Console:
    """Prints stage lines, each with the seconds since `started`."""

    def __init__(self, started: float) -> None:
        self.started = started

    def line(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f} s] {text}", flush=True)


def make_stage(console: Console, name: str, target: str, log: Path) -> bool:
    """Run `make target` with its output in `log`, unless it is up to date; False if it failed."""
    make = os.environ.get("MAKE", "make")
    if subprocess.run([make, "-q", target], cwd=REPO_ROOT, capture_output=True).returncode == 0:
        console.line(f"{name}: up to date")
        return True
    with open(log, "wb") as out:
        code = subprocess.run([make, target], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        console.line(f"{name}: failed (make {target} exited {code}); its output: {log}")
        print(tail(log), file=sys.stderr)
        return False
    console.line(f"{name}: done (output: {log})")
    return True


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def ray_session_logs(pid: int, root: Path | None = None) -> Path:
    """The log folder of the Ray session that process `pid` (serve run) started, in Ray's temp folder `root` (its
    default): Ray names a new cluster's session after its date and its starting process's pid. Where `pid` started
    none (it joined a running cluster), the session started last on this machine."""
    root = root or Path(os.environ.get("RAY_TMPDIR") or Path(tempfile.gettempdir()) / "ray")
    own = sorted(root.glob(f"session_*_{pid}"))
    return (own[-1] if own else (root / "session_latest").resolve()) / "logs"


def direct_ingress(url: str) -> str:
    """Where the ingress replica answers on its own port in Serve's throughput-optimized mode (`make serve`): the
    first port of Serve's range whose /health answers (a port taken by another process moves it up the range)."""
    first = os.environ.get("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT")
    if os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") != "1" or not first:
        return ""
    last = os.environ.get("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", first)
    parts = urllib.parse.urlsplit(url)
    for port in range(int(first), int(last) + 1):
        own = f"{parts.scheme}://{parts.hostname}:{port}"
        if health(own) is not None:
            return f", and on the ingress's own port: {own}/v1"
    return f" (the ingress's own port did not answer /health on {first}-{last})"


def health(url: str) -> dict | None:
    """The app's /health answer (200 or 503), or None while nothing answers."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            return json.loads(error.read())
        except ValueError:
            return None  # Serve's proxy before the app is deployed
    except (OSError, ValueError, http.client.HTTPException):
        return None  # nothing listening, or not HTTP/1.1 (another server took the port)


def watch(console: Console, proc: subprocess.Popen, log: Path, url: str) -> int:
    """Print the Ray, engine, calibration and ready lines as `serve run` (`proc`, printing to `log`) gets there;
    then wait for it to end. Returns its exit code."""
    ray_up, engines, ready = False, 0, False
    offset, carry = 0, b""  # how far serve run's output has been read, and its last bytes (a marker may straddle)
    while proc.poll() is None and not ready:
        if not ray_up:
            with open(log, "rb") as output:
                output.seek(offset)
                text = carry + output.read()
            offset += len(text) - len(carry)
            carry = text[-64:]
            ray_up = any(marker in text for marker in RAY_UP)
            if ray_up:
                console.line(f"Ray: started (every process's log, vLLM's included: {ray_session_logs(proc.pid)})")
        state = health(url) if ray_up else None
        if state is not None:
            while engines < state.get("replicas", 0):
                engines += 1
                console.line(f"engine {engines}: ready")
            if state.get("calibrated"):
                console.line("calibration: done")
                console.line(f"ready: {url}/v1{direct_ingress(url)} (serve run's output: {log}; Ctrl-C stops it)")
                ready = True
        time.sleep(POLL_S)
    code = proc.wait()
    if not ready:
        console.line(f"serve run exited {code} before the app was ready; the end of its output ({log}):")
        print(tail(log), file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the serve config `serve run` runs")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="where the app answers (Serve's proxy)")
    parser.add_argument("--log", type=Path, default=LOG_DIR / "serve_run.log", help="serve run's output")
    parser.add_argument("--address", help="passed to serve run (e.g. 'local')")
    args = parser.parse_args(argv)
    console = Console(time.monotonic())
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    if not (make_stage(console, "install", "setup", LOG_DIR / "install.log")
            and make_stage(console, "model preparation", "models", LOG_DIR / "models.log")):
        return 1
    command = [str(SERVE), "run", *(["--address", args.address] if args.address else []), args.config]
    with open(args.log, "wb") as out:
        proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)

    def stop(signum: int, _frame: object) -> None:
        # A terminal's Ctrl-C reaches serve run too (one process group); a SIGTERM sent to this process alone is
        # passed on, since serve run shuts its app down cleanly on it.
        if signum == signal.SIGTERM and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return watch(console, proc, args.log, args.url)


if __name__ == "__main__":
    sys.exit(main())
