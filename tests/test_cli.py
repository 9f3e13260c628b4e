import json
import os
import subprocess
import sys

import pytest
from family_runs import cli
from mpirun import REPO, SCRIPT_RUNNER, python, run_mpi


@pytest.mark.slow
def test_topo_in_a_single_process_needs_no_launcher():
    run = cli("topo", "--json")
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["world_size"] == 1 and report["launcher"] == "single"
    assert report["ranks"][0]["tp_group"] == [0] and report["ranks"][0]["device"] == "cpu"
    assert "mpi4py" not in run.stderr


def test_bad_size_in_a_single_process_is_exit_2_without_traceback():
    run = cli("topo", "--tp", "2")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "hpcllm: error: world size 1 is not divisible by tp*pp = 2*1 = 2; "
        "choose tp and pp whose product divides 1"
    ]


def test_topo_help_explains_every_option():
    run = cli("topo", "--help")
    assert run.returncode == 0
    for option in ("--tp", "--pp", "--dp", "--vpp", "--json"):
        assert option in run.stdout
    assert "Megatron" in run.stdout


def test_train_help_names_every_config_key():
    from hpcllm import families
    from hpcllm.config import fields

    run = cli("train", "--help")
    text = " ".join(run.stdout.split())
    for arch in families.names():  # the shared keys and each family's own
        for f in fields(arch):
            assert f" {f.key} " in text, f.key


@pytest.mark.parametrize("top", ["1", "50"], ids=["buffered", "written-while-running"])
@pytest.mark.parametrize("unbuffered", [False, True], ids=["block", "unbuffered"])
def test_a_reader_that_goes_away_ends_the_command_quietly(top, unbuffered):
    # `hpcllm plan | head -1`: the reader closes the pipe before the output is written. A
    # short output sits in stdout's buffer until the end; a long one is written while the
    # command runs.
    cluster = "jobs/clusters/dgx-a100.yaml"
    command = [sys.executable, "-m", "hpcllm", "plan", "--model", "gpt2-1.3b", "--gpus", "64",
               "--global-batch", "512", "--cluster", cluster, "--top", top]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    child = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    child.stdout.close()
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=120) == 141, stderr  # 128 + SIGPIPE, as Unix tools end
    assert stderr == ""


def test_a_broken_pipe_elsewhere_is_still_a_traceback(capfd):
    from hpcllm.errors import run_reporting_errors

    def writes_to_a_dead_child():
        raise BrokenPipeError(32, "Broken pipe")

    assert run_reporting_errors(writes_to_a_dead_child) == 1
    # stdout (a file here) is still writable: not the reader going away.
    assert "BrokenPipeError" in capfd.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize(("args", "code"), [(["topo", "--json"], 0), (["bench", "collectives"], 2)])
def test_a_command_that_started_torch_distributed_ends_without_finalising(tmp_path, args, code):
    # The hpcllm command (cli.run) ends such a process with os._exit after its exit handlers (so a
    # Gloo worker thread never meets a finalising interpreter): the handlers still run, the
    # output is all there, the exit code is the command's, and Python's finalisation (which
    # runs the objects' __del__) does not.
    mark = tmp_path / "atexit"
    script = (
        "import atexit, sys\n"
        "from hpcllm import cli\n"
        f"atexit.register(lambda: open({str(mark)!r}, 'w').write('ran'))\n"
        "class Finalised:\n"
        f"    def __del__(self, open=open): open({str(mark)!r} + '.del', 'w').write('del')\n"
        "keep = Finalised()\n"
        f"sys.argv = ['hpcllm', *{args!r}]\n"
        "cli.run()\n"
        "print('not reached')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert run.returncode == code, run.stderr
    assert mark.read_text() == "ran"
    assert not (tmp_path / "atexit.del").exists()
    assert "not reached" not in run.stdout
    if code == 0:
        assert json.loads(run.stdout)["world_size"] == 1
    else:  # a user error met after torch.distributed started
        assert run.stderr.startswith("hpcllm: error: hpcllm bench collectives runs under mpirun")


@pytest.mark.mpi
@pytest.mark.parametrize("through", ["script_runner", "plain-python"])
def test_a_gloo_callback_in_flight_at_exit_aborts_only_a_finalising_rank(through):
    # The remaining cause of "terminate called without an active exception" after a run that
    # succeeded: a Gloo worker thread runs (and then releases) the Python callbacks chained on
    # a collective's future, DDP's communication hooks, and one that meets a finalising
    # interpreter is ended inside C++. The suite's scripts finalised (only the hpcllm command
    # ended through exit_process); mpirun.python now starts them through
    # tests/script_runner.py, which ends them as the command does. plain-python is the
    # hazard itself, run as a script used to be: it must still abort, or this test no longer
    # exercises it.
    script = "tests/mpi_scripts/gloo_callback_at_exit.py"
    command = python(script) if through == "script_runner" else [sys.executable, script]
    assert (command[1] == str(SCRIPT_RUNNER)) == (through == "script_runner")
    result = run_mpi(2, command, timeout=120)
    output = result.stdout + result.stderr + "".join(result.rank_stderr.values())
    assert "returned" in result.rank_stdout.get(0, ""), output
    aborted = "terminate called without an active exception" in output
    if through == "script_runner":
        assert result.returncode == 0 and not aborted, output
    else:
        assert result.returncode != 0 and aborted, output


def test_every_command_keeps_the_options_it_had():
    """The option sets of every command and bench target against tests/recorded/cli_options.json
    (recorded before the commands became modules; `python tests/cli_options.py` re-records)."""
    import cli_options

    recorded = json.loads(cli_options.RECORDED.read_text())
    now = cli_options.current()
    assert sorted(now) == sorted(recorded)
    for command, options in recorded.items():
        assert now[command] == options, command


@pytest.mark.parametrize("words", [["--help"], ["plan", "--help"], ["bench", "step", "--help"]])
def test_help_imports_no_torch(words):
    code = (
        "import sys\nfrom hpcllm.cli import main\n"
        f"try:\n    main({words!r})\nexcept SystemExit as stop:\n    assert stop.code == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'mpi4py' not in sys.modules, 'mpi4py imported'"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "usage: hpcllm" in run.stdout


def test_the_command_line_module_and_every_function_stay_short():
    import ast

    assert len((REPO / "hpcllm" / "cli.py").read_text().splitlines()) <= 400
    long = []
    for root in ("hpcllm", "kernels", "datasets"):
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 120:
                        long.append(f"{path.relative_to(REPO)}: {node.name} ({lines} lines)")
    assert not long, "functions over 120 lines:\n" + "\n".join(long)
