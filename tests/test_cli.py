import json
import shutil
import subprocess
import sys

import pytest

from gradsync import planners
from gradsync.cli import main
from helpers import toy_profile


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "toy.json"
    toy_profile([(20000, 1, 2), (300, 1, 1), (50000, 2, 3), (1000, 1, 1)]).save(path)
    return str(path)


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_json_reports_a_valid_plan(capsys, profile_file, tmp_path):
    png = tmp_path / "timeline.png"
    code, out, _ = run(capsys, "plan", "--profile", profile_file, "--a", "1e-3", "--b", "1e-9",
                       "--scheduler", "wfbp", "--json", "--timeline", str(png))
    assert code == 0
    result = json.loads(out)
    assert result["allreduces"] == 4 and len(result["plans"]["plain"]["ops"]) == 4
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_host_time_per_op_is_charged_to_every_op(capsys, profile_file):
    times = {}
    for host in ("0", "1e-3"):
        code, out, _ = run(capsys, "plan", "--profile", profile_file, "--a", "1e-3", "--b", "1e-9", "--host", host,
                           "--scheduler", "wfbp", "--json")
        assert code == 0
        times[host] = json.loads(out)["iteration_time_ms"]
    # four ops, each launched in the backward pass and delaying what follows it by 1 ms: the last
    # op (the iteration's critical path) starts 4 ms later
    assert times["1e-3"] - times["0"] == pytest.approx(4.0, abs=0.01)


def test_slowdowns_lengthen_an_overlapped_iteration(capsys, profile_file):
    def iteration_ms(*flags):
        code, out, _ = run(capsys, "plan", "--profile", profile_file, "--a", "1e-3", "--b", "1e-7", *flags,
                           "--scheduler", "wfbp", "--json")
        assert code == 0
        return json.loads(out)["iteration_time_ms"]

    plain = iteration_ms()
    assert iteration_ms("--compute-slowdown", "2") > plain
    assert iteration_ms("--transfer-slowdown", "2") > plain


def test_plan_with_a_compressor_has_one_plan_per_layout(capsys):
    code, out, _ = run(capsys, "plan", "--model", "resnet50", "--cluster", "asc-wfbp-10gbe", "--workers", "8",
                       "--scheduler", "optimal_merge", "--compressor", "acp_sgd", "-c", "rank=4", "--json")
    assert code == 0
    result = json.loads(out)
    assert set(result["plans"]) == {"P", "Q"}
    assert all(op["codec"] == "acp_sgd" for plan in result["plans"].values() for op in plan["ops"])


def test_compression_shortens_the_predicted_iteration_of_a_large_model(capsys):
    times = {}
    for compressor in ([], ["--compressor", "acp_sgd"]):
        code, out, _ = run(capsys, "simulate", "--model", "bert_base", "--cluster", "asc-wfbp-10gbe",
                           "--schedulers", "optimal_merge", "--json", *compressor)
        assert code == 0
        times[bool(compressor)] = json.loads(out)["rows"][0]["iteration_time_ms"]
    assert times[True] < times[False] / 2


def test_simulate_table_has_every_scheduler(capsys, profile_file):
    code, out, _ = run(capsys, "simulate", "--profile", profile_file, "--cluster", "asc-wfbp-10gbe",
                       "--workers", "8", "--schedulers", "all", "--json")
    assert code == 0
    rows = json.loads(out)["rows"]
    assert [r["scheduler"].split()[0] for r in rows] == planners.names()
    wfbp = next(r for r in rows if r["scheduler"] == "wfbp")
    assert wfbp["speedup_over_wfbp"] == pytest.approx(1.0)
    best = min(r["iteration_time_ms"] for r in rows)
    auto = next(r for r in rows if r["scheduler"].startswith("auto"))
    assert best <= auto["iteration_time_ms"] <= best / (1 - 0.02)  # auto's default tolerance


def test_zoo_lists_models(capsys):
    code, out, _ = run(capsys, "zoo", "--json")
    assert code == 0
    models = {row["model"]: row for row in json.loads(out)}
    assert models["resnet50"]["parameters"] == 25_557_032


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--model", "alexnet", "--cluster", "asc-wfbp-10gbe", "--scheduler", "wfbp"], "resnet50"),
        (["plan", "--model", "resnet50", "--cluster", "asc-wfbp-10gbe", "--scheduler", "fastest"], "mg_wfbp"),
        (["plan", "--model", "resnet50", "--cluster", "nowhere", "--scheduler", "wfbp"], "asc-wfbp-10gbe"),
        (["plan", "--model", "resnet50", "--cluster", "asc-wfbp-10gbe", "--workers", "0", "--scheduler", "wfbp"],
         "'workers'"),
        (["simulate", "--model", "resnet50", "--a", "1e-3", "--b", "1e-9", "--workers", "0"], "'workers'"),
        (["plan", "--model", "resnet50", "--a", "0", "--b", "1e-9", "--scheduler", "wfbp"], "'a'"),
        (["plan", "--model", "resnet50", "--a", "1e-3", "--b", "-1", "--scheduler", "wfbp"], "'b'"),
        (["plan", "--model", "resnet50", "--a", "1e-3", "--b", "1e-9", "--gamma", "0.5", "--scheduler", "wfbp"],
         "'gamma'"),
        (["plan", "--model", "resnet50", "--cluster", "asc-wfbp-10gbe", "--host", "-1", "--scheduler", "wfbp"],
         "'host'"),
        (["plan", "--model", "resnet50", "--cluster", "asc-wfbp-10gbe", "--compute-slowdown", "0.5",
          "--scheduler", "wfbp"], "'compute_slowdown'"),
        (["plan", "--model", "resnet50", "--cluster", "asc-wfbp-10gbe", "--transfer-slowdown", "nan",
          "--scheduler", "wfbp"], "'transfer_slowdown'"),
        (["plan", "--model", "resnet50", "--cluster", "asc-wfbp-10gbe", "--scheduler", "us_byte",
          "-o", "partition_bytes=0"], "partition_bytes"),
        (["plan", "--model", "resnet50", "--cluster", "asc-wfbp-10gbe", "--scheduler", "wfbp",
          "--compressor", "zip"], "acp_sgd"),
        (["plan", "--model", "resnet50", "--cluster", "asc-wfbp-10gbe", "--scheduler", "wfbp",
          "--compressor", "acp_sgd", "-c", "rank=0"], "'rank'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("gradsync: error:") and err.count("\n") == 1
    assert message in err


def test_bad_profile_files(capsys, tmp_path):
    empty = tmp_path / "empty.json"
    empty.write_text('{"name": "x", "layers": []}')
    malformed = tmp_path / "bad.json"
    malformed.write_text("{oops")
    for path, message in ((empty, "layers"), (malformed, "malformed")):
        code, _, err = run(capsys, "plan", "--profile", str(path), "--cluster", "asc-wfbp-10gbe",
                           "--scheduler", "wfbp")
        assert code == 2 and message in err


def test_console_script_is_installed():
    script = shutil.which("gradsync") or str(__import__("pathlib").Path(sys.executable).with_name("gradsync"))
    done = subprocess.run([script, "plan", "--model", "nope", "--cluster", "asc-wfbp-10gbe", "--scheduler", "wfbp"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
