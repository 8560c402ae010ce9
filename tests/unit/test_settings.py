"""The settings object: sources, URL mapping, and docs/configuration.md staying in sync with it."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from gateway import settings as settings_module
from gateway.commands.main import build_parser
from gateway.commands.options import settings_table
from gateway.exposure import open_exposure
from gateway.machine import cpu_list, gpu_visible, plain_shared_build
from gateway.scheduling import runner_config
from gateway.settings import Settings, async_database_url


def test_database_urls_map_to_async_drivers() -> None:
    assert async_database_url("sqlite:///x.db") == "sqlite+aiosqlite:///x.db"
    assert async_database_url("postgresql://u@h/db") == "postgresql+asyncpg://u@h/db"
    assert async_database_url("postgresql+asyncpg://u@h/db") == "postgresql+asyncpg://u@h/db"
    with pytest.raises(ValueError, match="not a database URL"):
        async_database_url("kaizen.db")


def test_default_database_is_sqlite_under_data_dir(tmp_path: Path) -> None:
    settings = Settings.load(data_dir=tmp_path)
    assert settings.database_url == f"sqlite+aiosqlite:///{tmp_path.resolve() / 'kaizen.db'}"


def test_environment_beats_toml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "kaizen.toml"
    config.write_text('port = 9001\nhost = "0.0.0.0"\napi_keys = ["a", "b"]\n')
    monkeypatch.setenv("KAIZEN_PORT", "9002")
    monkeypatch.setenv("KAIZEN_ADMIN_KEY", "adm")
    settings = Settings.load(config)
    assert (settings.port, settings.host, settings.api_keys, settings.admin_key) == (
        9002,
        "0.0.0.0",
        ["a", "b"],
        "adm",
    )


def test_comma_separated_keys_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAIZEN_API_KEYS", "k1, k2,")
    assert Settings.load().api_keys == ["k1", "k2"]
    monkeypatch.setenv("KAIZEN_PORT", "eighty")
    with pytest.raises(ValueError, match="port"):
        Settings.load()


def test_blank_keys_in_a_config_file_are_no_keys(tmp_path: Path) -> None:
    # `api_keys = ["${KEY}"]` rendered with an empty variable: no key, so a public bind is refused (an empty
    # string in the list once counted as a key there, while the key ring, which drops it, served openly).
    config = tmp_path / "kaizen.toml"
    config.write_text('host = "0.0.0.0"\napi_keys = ["", " ", " k1 "]\ncors_origins = [""]\n')
    settings = Settings.load(config)
    assert (settings.api_keys, settings.cors_origins) == (["k1"], [])
    config.write_text('host = "0.0.0.0"\napi_keys = [""]\n')
    assert open_exposure(Settings.load(config)) is not None


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config file not found"):
        Settings.load(tmp_path / "nope.toml")


def test_every_setting_is_a_serve_flag_and_documented() -> None:
    serve_help = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    page = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    block = re.search(r"<!-- settings:start -->\n(.*?)<!-- settings:end -->", page, re.S)
    assert block is not None
    assert block.group(1).strip() == settings_table().strip(), (
        "docs/configuration.md settings table is stale: run `kaizen settings`"
    )
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in serve_help


def _leaves(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every runnable command's parser, by its words (`("keys", "create")`)."""
    subparsers = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subparsers:
        return {path: parser}
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for name, child in subparsers[0].choices.items():
        found.update(_leaves(child, (*path, name)))
    return found


def test_each_command_lists_its_own_options_and_the_common_three() -> None:
    """`kaizen keys create --help` once listed all of the server's settings; now only `serve` has them."""
    common = {"--config", "--data-dir", "--database-url"}
    settings_flags = {"--" + name.replace("_", "-") for name in Settings.model_fields} - common
    leaves = _leaves(build_parser())
    assert ("keys", "create") in leaves and ("serve",) in leaves
    for words, parser in leaves.items():
        flags = {flag for action in parser._actions for flag in action.option_strings}
        if words == ("serve",):
            assert settings_flags <= flags
        elif words != ("settings",):
            assert common <= flags, words
            # A command may take a setting it is about (`policy create --base-model`), never the server's.
            assert len(flags & settings_flags) <= 1, (words, sorted(flags & settings_flags))
    create_help = leaves[("keys", "create")].format_help()
    assert "--port" not in create_help and "--judge-model" not in create_help
    assert "--base-model" in leaves[("policy", "create")].format_help()


def test_training_processes_need_a_gpu_each_of_those_kaizen_train_gpus_names() -> None:
    assert Settings.load(train_processes=2, train_gpus="1,2").train_gpus == "1,2"
    assert Settings.load(train_gpus="1").train_gpus == "1"
    with pytest.raises(ValueError, match="KAIZEN_TRAIN_GPUS names 1 GPU"):
        Settings.load(train_processes=2, train_gpus="1")


def test_training_threads_leave_vllm_on_this_cpu_its_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """0 (the default) picks the training child's threads: 1 beside vLLM computing on this machine's cores (or
    the cores KAIZEN_VLLM_REPLICA_CPUS leaves it), ours where vLLM is elsewhere, on a GPU, or OMP_NUM_THREADS is
    set; a number is used as it is."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(settings_module, "gpu_visible", lambda _: False)
    cores = os.sched_getaffinity(0)
    assert Settings.load().training_threads() == 1
    assert Settings.load(vllm_url="http://127.0.0.1:8001/v1").training_threads() == 1
    assert Settings.load(vllm_url="http://localhost:8001/v1,http://[::1]:8002/v1").training_threads() == 1
    assert Settings.load(vllm_url="http://gpu-box:8001/v1").training_threads() == 0
    assert Settings.load(vllm_url="http://127.0.0.1:8001/v1,http://gpu-box:8001/v1").training_threads() == 0
    assert Settings.load(engine="upstream").training_threads() == 0
    assert Settings.load(train_threads=3).training_threads() == 3
    first = min(cores)
    split = Settings.load(vllm_replica_cpus=f"{first}").training_threads()
    assert split == max(1, len(cores) - 1)
    everything = ",".join(str(core) for core in cores)
    assert Settings.load(vllm_replica_cpus=everything).training_threads() == 1
    assert Settings.load(vllm_replica_cpus=f"{first};auto").training_threads() == 1  # cores vLLM picks
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert Settings.load().training_threads() == 0  # the child inherits the operator's choice
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(settings_module, "gpu_visible", lambda _: True)
    assert Settings.load().training_threads() == 0
    assert runner_config(Settings.load(train_threads=2)).train_threads == 2


def test_cpu_lists_and_hidden_gpus() -> None:
    assert cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert cpu_list("5") == {5}
    assert cpu_list("0-1|2-3") == {0, 1, 2, 3}  # one list per rank of a replica
    assert cpu_list("auto") is None and cpu_list("nobind") is None and cpu_list("0-") is None
    assert not gpu_visible("") and not gpu_visible("-1")


def test_plain_shared_python_builds_are_told_apart() -> None:
    shared = "7f7abc400000-7f7abc4a0000 r--p 00000000 08:01 1234 /root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0\n"
    static = "55d0c0000000-55d0c0100000 r-xp 00000000 08:01 99 /usr/bin/python3.11\n"
    pyenv = "'--prefix=/root/.pyenv/versions/3.11.7' '--enable-shared' '--libdir=/root/.pyenv/versions/3.11.7/lib'"
    docker = "'--enable-loadable-sqlite-extensions' '--enable-optimizations' '--enable-shared' '--with-lto'"
    debian = (
        "'--enable-shared' '--prefix=/usr' '--with-computed-gotos'"  # PGO by its own rules; static executable
    )
    assert plain_shared_build(pyenv, static + shared)
    assert not plain_shared_build(docker, static + shared)
    assert not plain_shared_build(debian, static)
    assert not plain_shared_build(pyenv, "")  # no /proc: no claim
