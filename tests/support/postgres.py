"""A throwaway PostgreSQL server from the machine's installed binaries, on a loopback port.

Runs `initdb`/`pg_ctl` directly, or through `runuser -u postgres` when the tests run as root (PostgreSQL
refuses to run as root). Used by the test suite and by `.ci/run` through it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.ports import free_port


def find_bin_dir() -> Path | None:
    """The newest Debian `/usr/lib/postgresql/<version>/bin`, else the directory of `initdb` on PATH."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[-3]))
    if candidates:
        return Path(candidates[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


class PostgresServer:
    """`root`: where the cluster lives (default: a fresh temporary directory); a cluster already there is
    started again as it was (`initialized`), which lets a benchmark keep a large database between runs."""

    def __init__(self, bin_dir: Path, root: Path | None = None) -> None:
        self.bin_dir = bin_dir
        self.port = free_port()
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)
        self.root = root or Path(tempfile.mkdtemp(prefix="kaizen-pg-"))
        self.data = self.root / "data"
        self.as_root = os.geteuid() == 0
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self.user = "postgres" if self.as_root else os.environ.get("USER", "postgres")

    def _run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self.as_root:
            command = ["runuser", "-u", "postgres", "--", *command]
        return subprocess.run(command, check=check, capture_output=True, text=True, timeout=120)

    @property
    def initialized(self) -> bool:
        return (self.data / "PG_VERSION").exists()

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.root} -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._run("pg_isready", "-h", "127.0.0.1", "-p", str(self.port), check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise TimeoutError("PostgreSQL did not become ready")

    def create_database(self, name: str, template: str | None = None) -> str:
        """An empty database, or a copy of `template` (a database nobody is connected to)."""
        copy = ["--template", template] if template else []
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, *copy, name)
        return self.url(name)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
