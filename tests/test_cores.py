"""CoreShare: engines on one host divide its cores among the busy ones (real files, real processes)."""

import os
import subprocess
import sys
import time

import pytest
import torch
from engine_helpers import drain, random_prompts

from splitserve.engine import cores
from splitserve.engine.config import EngineConfig, ModelSpec
from splitserve.engine.cores import CoreShare
from splitserve.engine.engine import LLMEngine
from splitserve.engine.errors import ModelLoadError
from splitserve.engine.sampling import SamplingParams


def _board(path, base=4):
    seen = []
    share = CoreShare(str(path), base, seen.append)
    return share, seen


def test_busy_engines_split_the_cores_and_an_idle_one_gives_its_share_back(tmp_path):
    a, a_seen = _board(tmp_path / "cores")
    b, b_seen = _board(tmp_path / "cores")
    c, c_seen = _board(tmp_path / "cores")
    try:
        assert len({a.slot, b.slot, c.slot}) == 3
        a.tick(force=True)
        assert a.threads == 4 and a_seen == []  # alone: every core, nothing to change
        b.tick(force=True)
        assert b.threads == 2 and b_seen == [2]
        a.tick(force=True)
        assert a.threads == 2 and a_seen == [2]
        c.tick(force=True)
        assert c.threads == 1 and c_seen == [1]  # 4 // 3
        assert a.busy_engines() == 3
        b.idle()
        c.idle()
        a.tick(force=True)
        assert a.threads == 4 and a_seen == [2, 4]
        assert a.busy_engines() == 1
    finally:
        for s in (a, b, c):
            s.close()


def test_ticks_between_layers_look_at_the_board_at_most_every_check_interval(tmp_path):
    a, a_seen = _board(tmp_path / "cores")
    b, _ = _board(tmp_path / "cores")
    try:
        a.tick(force=True)
        b.tick(force=True)
        a.tick()  # within CHECK_S of the last look: the new neighbour is not seen yet
        assert a.threads == 4
        time.sleep(cores.CHECK_S * 1.5)
        a.tick()
        assert a.threads == 2 and a_seen == [2]
    finally:
        a.close()
        b.close()


def test_a_stale_stamp_stops_counting(tmp_path):
    a, _ = _board(tmp_path / "cores", base=2)
    b, _ = _board(tmp_path / "cores", base=2)
    try:
        b.tick(force=True)
        a.tick(force=True)
        assert a.threads == 1
        # b stops computing without going idle (a hung or killed engine): its stamp ages out
        cores._SLOT.pack_into(b.mm, b.slot * cores._SLOT.size, time.monotonic() - cores.FRESH_S - 0.1)
        a.tick(force=True)
        assert a.threads == 2
    finally:
        a.close()
        b.close()


def test_a_dead_process_gives_its_slot_back(tmp_path):
    path = tmp_path / "cores"
    code = (
        "import sys, time; from splitserve.engine.cores import CoreShare; "
        "s = CoreShare(sys.argv[1], 2, lambda n: None); s.tick(force=True); print(s.slot, flush=True); time.sleep(60)"
    )
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "0"
        a, _ = _board(path)
        try:
            assert a.slot == 1  # slot 0 is the child's while it lives
            a.tick(force=True)
            assert a.threads == 2
        finally:
            a.close()
        child.kill()
        child.wait()
        b, _ = _board(path)
        try:
            assert b.slot == 0
        finally:
            b.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_an_engine_on_a_board_runs_its_share_of_threads_and_the_same_tokens(tiny_engine_factory, tmp_path):
    path = str(tmp_path / "cores")
    before = torch.get_num_threads()
    neighbour, _ = _board(path, base=2)
    try:
        alone = tiny_engine_factory(num_threads=2)
        shared = tiny_engine_factory(num_threads=2, core_share=path)
        prompts = random_prompts(4, seed=3)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        neighbour.tick(force=True)  # another engine is computing
        shared.add_request("r0", prompts[0], params)
        shared.step()
        assert shared.core_share.threads == 1 and torch.get_num_threads() == 1
        assert shared.model.attn_kernel is None or shared.model.attn_kernel.num_threads == 1
        drain(shared)
        assert shared.core_share.busy_engines() == 1  # idle once its work is done: only the neighbour counts
        neighbour.idle()
        assert shared.generate(prompts, params) == alone.generate(prompts, params)
        assert shared.core_share.threads == 2
    finally:
        neighbour.close()
        torch.set_num_threads(before)


def test_an_engine_loads_with_its_share_of_threads_and_is_idle_once_loaded(tiny_engine_factory, tmp_path, monkeypatch):
    """Loading computes (fp32 weights, packing): started beside a busy engine, an engine loads on
    its share of the cores. Guards against: it loaded on all of them: two workers starting side by side
    took twice the CPU time and twice as long."""
    from splitserve.engine import engine as engine_mod

    threads_at_load = []

    class Recording(engine_mod.LlamaModel):
        def __init__(self, loaded, laid_out=None, dtype="float32"):
            threads_at_load.append(torch.get_num_threads())
            super().__init__(loaded, laid_out, dtype)

    monkeypatch.setattr(engine_mod, "LlamaModel", Recording)
    path = str(tmp_path / "cores")
    before = torch.get_num_threads()
    neighbour, _ = _board(path, base=2)
    try:
        neighbour.tick(force=True)  # another engine is computing
        busy = tiny_engine_factory(num_threads=2, core_share=path)
        assert threads_at_load == [1]
        assert busy.core_share.busy_engines() == 1  # loaded: its slot is idle, only the neighbour counts
        neighbour.idle()
        alone = tiny_engine_factory(num_threads=2, core_share=path)
        assert threads_at_load == [1, 2]
        assert alone.core_share.busy_engines() == 0
    finally:
        neighbour.close()
        torch.set_num_threads(before)


def test_an_engine_whose_model_fails_to_load_gives_its_slot_back(tmp_path):
    path = str(tmp_path / "cores")
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLMEngine(EngineConfig(model=ModelSpec(path=str(tmp_path / "missing")), core_share=path, num_threads=2))
    probe, _ = _board(path, base=2)
    try:
        assert probe.slot == 0  # free again (not: held by the failed engine's descriptor)
        probe.tick(force=True)
        assert probe.busy_engines() == 1  # and not stamped busy
    finally:
        probe.close()


def test_an_engine_looks_at_the_board_between_layers_of_a_long_forward(tiny_engine_factory, tmp_path):
    path = str(tmp_path / "cores")
    before = torch.get_num_threads()
    neighbour, _ = _board(path, base=2)
    try:
        eng = tiny_engine_factory(num_threads=2, core_share=path)
        tick = eng.model.on_layer
        assert tick is not None
        layers = []

        def on_layer():  # a neighbour starts computing while this forward is at its second layer
            if len(layers) == 1:
                neighbour.tick(force=True)
                time.sleep(cores.CHECK_S * 1.5)
            tick()
            layers.append(eng.core_share.threads)  # the threads this layer runs with

        eng.model.on_layer = on_layer
        eng.add_request("r0", random_prompts(1, lo=100, hi=101)[0], SamplingParams(max_tokens=1, ignore_eos=True))
        drain(eng)
        assert len(layers) == eng.model.shape.num_layers
        assert layers[0] == 2 and layers[1:] == [1] * (len(layers) - 1)  # the forward in progress took its share
    finally:
        neighbour.close()
        torch.set_num_threads(before)


def test_a_board_that_cannot_be_opened_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="core_share .*missing"):
        CoreShare(str(tmp_path / "missing" / "cores"), 2, lambda n: None)


@pytest.mark.parametrize("role", ["decode_worker", "prefill_worker"])
def test_a_worker_refuses_a_board_it_cannot_open_in_one_line(tmp_path, role, smol_folder):
    env = {**os.environ, "SPLITSERVE_CORE_SHARE": str(tmp_path / "missing" / "cores"), "SPLITSERVE_MODEL": smol_folder}
    proc = subprocess.run(
        [sys.executable, "-m", f"splitserve.{role}"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"splitserve {role}: error: core_share '{tmp_path / 'missing' / 'cores'}'" in proc.stderr


def _cgroup(tmp_path, lines: list[str], files: dict[str, str]):
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("\n".join(lines) + "\n")
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(root), str(proc)


@pytest.mark.parametrize(
    "raw, board", [("", ""), ("off", ""), ("False", ""), ("0", ""), ("/run/x/cores", "/run/x/cores")]
)
def test_the_core_share_setting_names_a_board_or_is_off(raw, board):
    from splitserve.service.settings import Settings

    s = Settings.from_env({"SPLITSERVE_CORE_SHARE": raw})
    assert s.core_share_board == board
    assert s.engine_config("prefill").core_share == board == s.engine_config("decode").core_share


def test_core_share_on_is_the_stacks_own_board_and_refused_by_a_process_on_its_own(tmp_path, monkeypatch):
    """ "on" is no file name. Guards against: a worker given it made a board called "on" in its working
    directory. A stack gives its workers its own board; a process started alone says what to set."""
    from splitserve.service.process import parse_settings
    from splitserve.service.settings import Settings
    from splitserve.stack import Stack

    monkeypatch.chdir(tmp_path)
    for raw in ("on", "TRUE"):
        stack = Stack(Settings.from_env({"SPLITSERVE_CORE_SHARE": raw}), run_dir=str(tmp_path / raw))
        assert stack.settings.core_share_board == str(tmp_path / raw / "cores")
        monkeypatch.setenv("SPLITSERVE_CORE_SHARE", raw)
        with pytest.raises(ValueError, match=f"SPLITSERVE_CORE_SHARE: '{raw}' names no board file"):
            parse_settings("prefill_worker", [])
    monkeypatch.setenv("SPLITSERVE_CORE_SHARE", "off")
    assert parse_settings("prefill_worker", []).core_share_board == ""
    off = Stack(Settings.from_env({"SPLITSERVE_CORE_SHARE": "off"}), run_dir=str(tmp_path))
    assert off.settings.core_share_board == ""
    assert list(tmp_path.iterdir()) == []  # no board called "on" in the working directory


def test_the_cgroup_cpu_quota_is_read_from_v2_and_v1_the_smallest_on_the_path_wins(tmp_path):
    from splitserve.engine.config import cgroup_cpu_limit

    root, proc = _cgroup(
        tmp_path / "v2",
        ["0::/kubepods/pod1/ctr"],
        {"cpu.max": "max 100000", "kubepods/cpu.max": "800000 100000", "kubepods/pod1/ctr/cpu.max": "150000 100000"},
    )
    assert cgroup_cpu_limit(root, proc) == 1.5
    root, proc = _cgroup(tmp_path / "v2none", ["0::/"], {"cpu.max": "max 100000"})
    assert cgroup_cpu_limit(root, proc) is None
    root, proc = _cgroup(
        tmp_path / "v1",
        ["4:memory:/x", "1:cpu,cpuacct:/docker/abc", "0::/"],
        {
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
            "cpu,cpuacct/cpu.cfs_quota_us": "-1",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
        },
    )
    assert cgroup_cpu_limit(root, proc) == 2.0
    root, proc = _cgroup(
        tmp_path / "v1none", ["1:cpu:/"], {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}
    )
    assert cgroup_cpu_limit(root, proc) is None
    assert cgroup_cpu_limit(root, str(tmp_path / "no-such-file")) is None


def test_every_core_means_the_affinity_capped_by_the_quota_rounded_up(monkeypatch):
    from splitserve.engine import config

    affinity = len(os.sched_getaffinity(0))
    monkeypatch.setattr(config, "cgroup_cpu_limit", lambda: None)
    assert config.EngineConfig().threads() == affinity
    monkeypatch.setattr(config, "cgroup_cpu_limit", lambda: 0.5)
    assert config.EngineConfig().threads() == 1
    monkeypatch.setattr(config, "cgroup_cpu_limit", lambda: 64.0)
    assert config.EngineConfig().threads() == affinity
    if affinity >= 2:
        monkeypatch.setattr(config, "cgroup_cpu_limit", lambda: 1.2)
        assert config.EngineConfig().threads() == 2
    assert config.EngineConfig(num_threads=3).threads() == 3  # an explicit count wins
