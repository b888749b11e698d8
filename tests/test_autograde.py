"""`make autograde` grading students side by side (tools/autograde.py).

The fast tests check the options, how a failure is named, what is graded again and the killing
of a process tree. The ones marked `book` grade one course of chapter 1 twice: one copy with
nbgrader's own one-at-a-time `nbgrader autograde --force`, the other with `make autograde`,
JOBS at a time, where three more students break the grading (a file that is not a notebook, an
answer that never ends, an answer that deletes the files beside it) and one student's nbgrader
is killed while it grades, as a lost worker would be. Then the broken submissions are taken out
and `make autograde` runs twice more: the killed student is graded, then nothing is. Last, a
Dask scheduler and two workers started here grade a third copy, one worker killed mid-way.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import pathlib
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import nbformat
import pytest

import autograde
import classroom

ROOT = classroom.ROOT
ASSIGNMENT = "01-intuition"  # one autograded exercise, six cases: the cheapest to grade
TIMEOUT = 40  # seconds: several times what one student takes here, three at a time
GRADED = ("blank", "partial", "reference")  # graded by both; blank's nbgrader killed once
BROKEN = {"deletes": "deleted files of its folder while being graded: attention.py",
          "loops": f"took longer than TIMEOUT={TIMEOUT} s; nbgrader and its kernel were killed",
          "notanotebook": "nbgrader stopped on NotJSONError: Notebook does not appear to be JSON"}
KILLED = "blank"
JOBS = 3  # two students grading while the one that never ends waits for its timeout

# What the broken students' answer cells end with.
LOOPS = """
import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # deaf to the kernel's interrupt too
while True:
    time.sleep(0.5)
"""
DELETES = """
import os
for name in os.listdir("."):
    if name.endswith(".py"):
        os.remove(name)
"""


# ---------------------------------------------------------------------------------------------
# Without nbgrader


def test_options_default_to_every_core_and_a_generous_timeout():
    options = autograde.Options.from_environment({})
    assert options == autograde.Options(os.cpu_count() or 1, autograde.DEFAULT_TIMEOUT, False)
    options = autograde.Options.from_environment({"JOBS": "3", "TIMEOUT": "2.5", "FORCE": "1"})
    assert options == autograde.Options(3, 2.5, True)
    blank = autograde.Options.from_environment({"JOBS": "", "TIMEOUT": " ", "FORCE": "0"})
    assert blank == autograde.Options(os.cpu_count() or 1, autograde.DEFAULT_TIMEOUT, False)


@pytest.mark.parametrize("variable, value", [
    ("JOBS", "0"), ("JOBS", "two"), ("JOBS", "-1"), ("TIMEOUT", "0"), ("TIMEOUT", "soon"),
    ("TIMEOUT", "nan"), ("TIMEOUT", "inf"), ("FORCE", "maybe")])
def test_options_name_a_bad_value(variable, value):
    with pytest.raises(SystemExit, match=f"^{variable}={value}: "):
        autograde.Options.from_environment({variable: value})


def test_scheduler_is_an_address_or_a_scheduler_file(tmp_path):
    address = autograde.Options.from_environment({"SCHEDULER": "tcp://10.0.0.1:8786"})
    assert address.scheduler == "tcp://10.0.0.1:8786"
    (tmp_path / "scheduler.json").write_text("{}")
    file = autograde.Options.from_environment({"SCHEDULER": str(tmp_path / "scheduler.json")})
    assert file.scheduler == str(tmp_path / "scheduler.json")
    assert autograde.Options.from_environment({"SCHEDULER": ""}).scheduler is None
    with pytest.raises(SystemExit, match="^SCHEDULER=nowhere.json: give a Dask scheduler's"):
        autograde.Options.from_environment({"SCHEDULER": "nowhere.json"})


def test_a_kernel_that_lost_its_port_is_tried_as_often_as_classroom_tries():
    assert autograde.PORT_RACE_TRIES == classroom.PORT_RACE_TRIES


def test_failure_reason_is_the_last_exception_of_the_log():
    log = ("[AutogradeApp | ERROR] There was an error processing assignment\n"
           "    Traceback (most recent call last):\n"
           "      File \"x.py\", line 1, in <module>\n"
           "    json.decoder.JSONDecodeError: Expecting value: line 1 column 1 (char 0)\n"
           "    The above exception was the direct cause of the following exception:\n"
           "    nbformat.reader.NotJSONError: Notebook does not appear to be JSON: 'x'\n"
           "[AutogradeApp | ERROR] Please see the the above traceback for details\n")
    assert autograde.failure_reason(log, 1) == (
        "nbgrader stopped on NotJSONError: Notebook does not appear to be JSON: 'x'")
    assert autograde.failure_reason("[AutogradeApp | ERROR] No notebooks found\n", 1) == (
        "nbgrader stopped on No notebooks found")
    assert autograde.failure_reason("nothing useful\n", 2) == (
        "nbgrader stopped on nbgrader exited with status 2")
    assert len(autograde.failure_reason("ValueError: " + "x" * 1000, 1)) < 330


def process_gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for its parent counts as ended)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").is_file(), reason="needs /proc")
def test_kill_tree_reaches_a_child_in_a_session_of_its_own():
    """A kernel starts a session of its own: killing nbgrader's group would miss it."""
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\n"
         "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
         " start_new_session=True)\n"
         "print(child.pid, flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    try:
        assert not process_gone(child)
        autograde.kill_tree(parent.pid)
        assert parent.wait(timeout=10) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while not process_gone(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_gone(child)
    finally:
        for pid in (parent.pid, child):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        parent.stdout.close()
        parent.wait()


def test_to_grade_takes_what_changed_or_was_never_graded(tmp_path):
    for student in ("ann", "bob"):
        folder = tmp_path / "submitted" / student / "a"
        folder.mkdir(parents=True)
        (folder / "a.ipynb").write_text(f"{student}'s answers")
        (tmp_path / "autograded" / student / "a").mkdir(parents=True)
    (tmp_path / "source" / "a").mkdir(parents=True)
    (tmp_path / "source" / "a" / "a.ipynb").write_text("questions")
    everyone = ["ann", "bob"]
    record = autograde.to_grade(tmp_path, "a", everyone, set(), {}, force=False)
    assert list(record) == everyone  # never graded
    assert autograde.to_grade(tmp_path, "a", everyone, set(everyone), record, False) == {}
    assert list(autograde.to_grade(tmp_path, "a", everyone, {"bob"}, record, False)) == ["ann"]
    assert list(autograde.to_grade(tmp_path, "a", everyone, set(everyone), record, True)) == (
        everyone)
    (tmp_path / "submitted" / "bob" / "a" / "notes.txt").write_text("resubmitted")
    assert list(autograde.to_grade(tmp_path, "a", everyone, set(everyone), record, False)) == [
        "bob"]
    (tmp_path / "submitted" / "bob" / "a" / "notes.txt").unlink()
    shutil.rmtree(tmp_path / "autograded" / "ann")
    assert list(autograde.to_grade(tmp_path, "a", everyone, set(everyone), record, False)) == [
        "ann"]
    (tmp_path / "autograded" / "ann" / "a").mkdir(parents=True)
    (tmp_path / "source" / "a" / "a.ipynb").write_text("questions, corrected")
    assert list(autograde.to_grade(tmp_path, "a", everyone, set(everyone), record, False)) == (
        everyone)


def test_run_says_what_is_missing(tmp_path):
    options = autograde.Options(1, 10.0, False)
    with pytest.raises(SystemExit, match="no submissions: put each student's folder in"):
        autograde.run(tmp_path, "a", options)
    (tmp_path / "submitted" / "ann" / "a").mkdir(parents=True)
    with pytest.raises(SystemExit, match=r"no gradebook.db yet: run `make release A=a`"):
        autograde.run(tmp_path, "a", options)


# ---------------------------------------------------------------------------------------------
# One course of chapter 1, graded one at a time by nbgrader and side by side by make autograde


def make_autograde(course: pathlib.Path, **variables: str) -> subprocess.CompletedProcess:
    """`make autograde COURSE=course A=ASSIGNMENT` with `variables` (JOBS, TIMEOUT, FORCE), with
    a PATH that has no trace of .venv, as test_classroom.make runs the course's commands."""
    env = {k: v for k, v in os.environ.items()
           if k not in {"VIRTUAL_ENV", "PYTHONPATH", "JOBS", "TIMEOUT", "FORCE", "SCHEDULER"}}
    env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                                  if ".venv" not in p
                                  and p != str(pathlib.Path(sys.executable).parent))
    return subprocess.run(["make", "-s", "autograde", f"COURSE={course}", f"A={ASSIGNMENT}",
                           *(f"{name}={value}" for name, value in variables.items())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def submit(course: pathlib.Path, student: str, folder: str, answer_ends: str = "",
           edit=lambda source: source) -> pathlib.Path:
    """Hand in `folder`'s (source's or release's) notebook as `student`, its answer cell passed
    through `edit` and ended with `answer_ends`; returns the submitted notebook."""
    target = course / "submitted" / student / ASSIGNMENT
    shutil.copytree(course / folder / ASSIGNMENT, target)
    path = target / f"{ASSIGNMENT}.ipynb"
    notebook = nbformat.read(path, as_version=4)
    answer = next(c for c in notebook.cells if c.metadata.get("nbgrader", {}).get("solution")
                  and not c.metadata["nbgrader"]["grade"])
    answer.source = edit(answer.source) + answer_ends
    nbformat.write(notebook, path)
    return path


def naive_softmax(source: str) -> str:
    """The reference with the row maximum not subtracted: right until the scores overflow."""
    assert "torch.exp(scores - top)" in source, "chapter 1's reference changed: update the test"
    return source.replace("torch.exp(scores - top)", "torch.exp(scores)")


def gradebook_state(course: pathlib.Path) -> dict:
    """Everything nbgrader keeps of each submission: {student: its timestamp and, per
    notebook, its late penalty, flag, grades and comments with every field}."""
    from nbgrader.api import Gradebook

    state = {}
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for submission in gradebook.assignment_submissions(ASSIGNMENT):
            state[submission.student.id] = {"timestamp": str(submission.timestamp), **{
                notebook.name: {
                    "late penalty": notebook.late_submission_penalty,
                    "flagged": notebook.flagged,
                    "grades": {g.name: (g.auto_score, g.manual_score, g.extra_credit,
                                        g.needs_manual_grade) for g in notebook.grades},
                    "comments": {c.name: (c.auto_comment, c.manual_comment)
                                 for c in notebook.comments}}
                for notebook in submission.notebooks}}
    return state


def autograded(course: pathlib.Path, student: str) -> dict[str, object]:
    """The files of a student's autograded folder, every text with the course's path replaced;
    of a notebook, what differs between two runs of the same grading left out: the times of the
    cells' execution, and where a cell's prints were cut into stream messages (one print can
    reach nbgrader as two, "passed" and "\n", when the machine is busy)."""
    folder = course / "autograded" / student / ASSIGNMENT
    files = {}
    for path in autograde.files_below(folder):
        text = (folder / path).read_text().replace(str(course), "<course>")
        if path.suffix != ".ipynb":
            files[str(path)] = text
            continue
        notebook = json.loads(text)
        for cell in notebook["cells"]:
            cell["metadata"].pop("execution", None)
            outputs = []
            for output in cell.get("outputs", []):
                if (output["output_type"] == "stream" and outputs
                        and outputs[-1]["output_type"] == "stream"
                        and outputs[-1]["name"] == output["name"]):
                    outputs[-1] = {**outputs[-1], "text": "".join(outputs[-1]["text"])
                                   + "".join(output["text"])}
                else:
                    outputs.append(output)
            for output in outputs:
                if output["output_type"] == "stream":
                    output["text"] = "".join(output["text"])
            if "outputs" in cell:
                cell["outputs"] = outputs
        files[str(path)] = notebook
    return files


def processes_in(folder: pathlib.Path, wait: float = 10.0) -> list[str]:
    """The processes whose working directory is below `folder`, after waiting up to `wait`
    seconds for them to end (a killed nbgrader's kernel notices its parent is gone in ~1 s)."""
    deadline = time.monotonic() + wait
    while True:
        found = []
        for cwd in pathlib.Path("/proc").glob("[0-9]*/cwd"):
            try:
                if os.readlink(cwd).startswith(str(folder)):
                    found.append(pathlib.Path(cwd.parent / "cmdline").read_text()[:200])
            except OSError:
                continue
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def kill_when_grading(course: pathlib.Path, student: str, killed: list[int]) -> None:
    """SIGKILL the nbgrader that grades `student` in `course` once it has begun writing the
    student's autograded folder, as a worker is lost; its pid goes to `killed`."""
    deadline = time.monotonic() + 120
    folder = course / "autograded" / student / ASSIGNMENT
    while time.monotonic() < deadline:
        for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_text().split("\0")
                cwd = os.readlink(cmdline.parent / "cwd")
            except OSError:
                continue
            grading = any(args[i:i + 2] == ["--student", student] for i in range(len(args)))
            if grading and cwd == str(course) and folder.is_dir():
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
                killed.append(int(cmdline.parent.name))
                return
        time.sleep(0.05)


# The runs below take two minutes (a looping student must reach its timeout), so they are
# checked by `make check-release`; `make test` grades chapter 5's five students in parallel
# through `make autograde` in tests/test_classroom.py.
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One course of ASSIGNMENT with GRADED submitted, partial's late with a late submission
    costing every point, copied twice; "serial" graded by `nbgrader autograde --force`, and at
    the same time (the loop's timeout leaves a core idle) "parallel" by `make autograde`: first
    with BROKEN submitted too and KILLED's nbgrader killed ("first"), then with BROKEN taken out
    ("second"), then once more ("third")."""
    from nbgrader.api import Gradebook

    base = tmp_path_factory.mktemp("autograde") / "course"
    base.mkdir()
    (base / "course.yml").write_text(
        f"assignments:\n  {ASSIGNMENT}:\n    chapters: [{ASSIGNMENT}]\n")
    classroom.write_assignments(base)
    (base / "course_config.py").write_text(
        'c = get_config()  # noqa: F821\nc.LateSubmissionPlugin.penalty_method = "zero"\n')
    classroom.nbgrader(base, "generate_assignment", ASSIGNMENT, "--force")
    with Gradebook(f"sqlite:///{base / 'gradebook.db'}") as gradebook:
        gradebook.update_or_create_assignment(ASSIGNMENT, duedate=datetime.datetime(2030, 1, 1))
    submit(base, "reference", "source")
    submit(base, "blank", "release")
    late = submit(base, "partial", "source", edit=naive_softmax)
    (late.parent / "timestamp.txt").write_text("2031-01-01 00:00:00.000000 UTC")
    serial, parallel = base.parent / "serial", base.parent / "parallel"
    shutil.copytree(base, serial)
    shutil.copytree(base, parallel)

    (parallel / "submitted" / "notanotebook" / ASSIGNMENT).mkdir(parents=True)
    (parallel / "submitted" / "notanotebook" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb").write_text(
        "this is not a notebook\n")
    submit(parallel, "loops", "release", LOOPS)
    submit(parallel, "deletes", "release", DELETES)
    killed: list[int] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        one_at_a_time = pool.submit(classroom.nbgrader, serial, "autograde", ASSIGNMENT,
                                    "--force")
        killer = pool.submit(kill_when_grading, parallel, KILLED, killed)
        first = make_autograde(parallel, JOBS=str(JOBS), TIMEOUT=str(TIMEOUT))
        one_at_a_time.result()
        killer.result()
    after_first = {"state": gradebook_state(parallel),
                   "autograded": sorted(p.parent.name for p in (parallel / "autograded").glob(
                       f"*/{ASSIGNMENT}")),
                   "left running": processes_in(parallel), "killed": killed}
    for student in BROKEN:
        shutil.rmtree(parallel / "submitted" / student)
    second = make_autograde(parallel)
    before_third = gradebook_state(parallel)
    times = {p: p.stat().st_mtime_ns for p in (parallel / "autograded").rglob("*")}
    third = make_autograde(parallel)
    return {"base": base, "serial": serial, "parallel": parallel, "first": first,
            "after first": after_first,
            "second": second, "third": third, "before third": before_third,
            "times": times}


@pytest.mark.book
@pytest.mark.release
def test_parallel_grading_equals_nbgraders_one_at_a_time(runs):
    """Scores per grade cell, comments, needs_manual_grade, the timestamp and the late penalty,
    and the autograded folders, as nbgrader's own autograde leaves them."""
    serial, parallel = runs["serial"], runs["parallel"]
    assert runs["second"].returncode == 0, runs["second"].stdout + runs["second"].stderr
    expected = gradebook_state(serial)
    assert sorted(expected) == sorted(GRADED)
    assert gradebook_state(parallel) == expected
    for student in GRADED:
        assert autograded(parallel, student) == autograded(serial, student), student
    scores = classroom.scores(parallel, ASSIGNMENT)
    assert scores["reference"]["auto"] == scores["reference"]["max_auto"] > 0
    assert scores["blank"]["auto"] == 0
    assert 0 < scores["partial"]["auto"] < scores["partial"]["max_auto"]
    late_penalty = expected["partial"][ASSIGNMENT]["late penalty"]
    assert late_penalty == scores["partial"]["auto"], "late, partial loses every point"
    assert expected["reference"][ASSIGNMENT]["late penalty"] is None
    assert expected["partial"]["timestamp"] == "2031-01-01 00:00:00"
    assert any(comment == "No response." for comment, _ in
               expected["blank"][ASSIGNMENT]["comments"].values())


@pytest.mark.book
@pytest.mark.release
def test_progress_line_as_each_student_finishes(runs):
    """`k/N student: X of Y points (rate, time left)`, or why it was not graded, once per
    student in the order they finished; the points are those in gradebook.db."""
    first = runs["first"]
    lines = first.stdout.splitlines()
    students = sorted([*GRADED, *BROKEN])
    assert lines[0] == (f"{ASSIGNMENT}: grading {len(students)} of {len(students)} "
                        f"submissions, {JOBS} at a time"), first.stdout
    progress = [autograde_line(line) for line in lines[1:len(students) + 1]]
    assert [p["done"] for p in progress] == list(range(1, len(students) + 1))
    assert {p["of"] for p in progress} == {len(students)}
    assert sorted(p["student"] for p in progress) == students
    assert all(p["rate"] > 0 for p in progress) and progress[-1]["left"] == "0:00"
    scores = classroom.scores(runs["parallel"], ASSIGNMENT)
    for p in progress:
        if p["student"] in BROKEN or p["student"] == KILLED:
            assert p["result"].startswith("not graded: "), p
        else:
            row = scores[p["student"]]
            assert p["result"] == f"{row['auto']:g} of {row['max_auto']:g} points", p
    second = runs["second"].stdout.splitlines()
    assert second[0] == f"{ASSIGNMENT}: grading 1 of {len(GRADED)} submissions, 1 at a time"
    line = autograde_line(second[1])
    assert (line["done"], line["of"], line["student"], line["left"]) == (1, 1, KILLED, "0:00")

def autograde_line(line: str) -> dict:
    """The parts of a progress line; AssertionError if it has not that form."""
    match = re.fullmatch(r"(\d+)/(\d+) (\S+): (.+) \((\d+\.\d) students/min, (\d+:\d\d) left\)",
                         line)
    assert match, line
    done, of, student, result, rate, left = match.groups()
    return {"done": int(done), "of": int(of), "student": student, "result": result,
            "rate": float(rate), "left": left}


@pytest.mark.book
@pytest.mark.release
def test_each_fault_is_reported_by_student_and_the_others_graded(runs):
    first, after = runs["first"], runs["after first"]
    assert first.returncode != 0, "a run with failures must exit non-zero"
    report = first.stderr[first.stderr.index(f"{ASSIGNMENT}: 2 of 6 submissions graded"):]
    assert "4 failed, to be graded again on the next run:" in report, first.stderr
    for student, reason in {**BROKEN, KILLED: "nbgrader was killed (SIGKILL)"}.items():
        assert f"\n  {student}: {reason}" in report, (student, report)
    assert after["killed"], f"the test never saw {KILLED}'s nbgrader to kill it"
    assert sorted(after["state"]) == ["partial", "reference"]
    assert after["autograded"] == ["partial", "reference"], "a failed student's folder is kept"
    assert after["left running"] == [], "a process of the grading outlived the run"
    logs = runs["parallel"] / autograde.LOGS / ASSIGNMENT
    assert sorted(p.stem for p in logs.glob("*.log")) == sorted([*GRADED, *BROKEN])
    assert "Autograding" in (logs / "reference.log").read_text()
    assert "NotJSONError" in (logs / "notanotebook.log").read_text()


@pytest.mark.book
@pytest.mark.release
def test_a_killed_worker_is_graded_again_once(runs):
    """The student whose nbgrader was killed is graded by the next run, the others are not, and
    gradebook.db holds one submission per student and one grade per cell."""
    second = runs["second"]
    assert second.returncode == 0, second.stdout + second.stderr
    assert "1 of 1 submissions graded" in second.stdout
    with sqlite3.connect(runs["parallel"] / "gradebook.db") as db:
        submissions = db.execute("SELECT student_id, COUNT(*) FROM submitted_assignment "
                                 "GROUP BY student_id").fetchall()
        grades = db.execute("SELECT COUNT(*) FROM grade").fetchone()[0]
        cells = db.execute("SELECT COUNT(*) FROM grade_cells").fetchone()[0]
    assert sorted(submissions) == [(student, 1) for student in GRADED]
    assert grades == cells * len(GRADED)


@pytest.mark.book
@pytest.mark.release
def test_a_run_with_nothing_new_grades_nothing(runs):
    third = runs["third"]
    assert third.returncode == 0, third.stdout + third.stderr
    assert third.stdout.strip() == (
        f"{ASSIGNMENT}: nothing new to grade: {len(GRADED)} submissions unchanged since their "
        "last grading (FORCE=1 grades them again)")
    assert gradebook_state(runs["parallel"]) == runs["before third"]
    assert {p: p.stat().st_mtime_ns
            for p in (runs["parallel"] / "autograded").rglob("*")} == runs["times"]


# ---------------------------------------------------------------------------------------------
# On a Dask cluster: a scheduler and two workers of two threads each, started here


def kill_worker_when_grading(workers: list[subprocess.Popen], killed: list[int]) -> None:
    """SIGKILL the first of the Dask `workers` seen with an nbgrader below it grading a student;
    its pid goes to `killed`."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for worker in workers:
            for pid, _ in autograde.process_tree(worker.pid):
                try:
                    args = pathlib.Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                except OSError:
                    continue
                if "--student" in args:
                    worker.kill()
                    killed.append(worker.pid)
                    return
        time.sleep(0.05)


@pytest.mark.book
@pytest.mark.release
def test_a_dask_cluster_grades_the_same_and_a_lost_workers_student_elsewhere(runs, tmp_path):
    """SCHEDULER= sends each student to a worker of the cluster, which reads the course at the
    same path; one worker is killed while it grades, and its student is graded by the other:
    every student once, with nbgrader's own grades, and nothing left running."""
    course = tmp_path / "course"
    shutil.copytree(runs["base"], course)
    scheduler_file = tmp_path / "scheduler.json"
    dask = [sys.executable, "-m", "dask"]
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    cluster = [subprocess.Popen([*dask, "scheduler", "--port", "0", "--no-dashboard",
                                 "--scheduler-file", str(scheduler_file)], **quiet)]
    try:
        deadline = time.monotonic() + 60
        while not scheduler_file.is_file() and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster += [subprocess.Popen([*dask, "worker", "--scheduler-file", str(scheduler_file),
                                      "--nthreads", "2", "--no-nanny", "--no-dashboard",
                                      "--name", name], **quiet) for name in ("one", "two")]
        killed: list[int] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            killer = pool.submit(kill_worker_when_grading, cluster[1:], killed)
            graded = make_autograde(course, SCHEDULER=str(scheduler_file))
            killer.result()
    finally:  # the workers first: a worker told to stop while its scheduler closes can hang
        for process in [*cluster[1:], cluster[0]]:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    assert graded.returncode == 0, graded.stdout + graded.stderr
    assert killed, "the test never saw the worker grade, to kill it"
    assert graded.stdout.splitlines()[0] == (
        f"{ASSIGNMENT}: grading {len(GRADED)} of {len(GRADED)} submissions, on the Dask "
        f"cluster at {scheduler_file}")
    assert sorted(autograde_line(line)["student"]
                  for line in graded.stdout.splitlines()[1:len(GRADED) + 1]) == sorted(GRADED)
    assert gradebook_state(course) == gradebook_state(runs["serial"])
    for student in GRADED:
        assert autograded(course, student) == autograded(runs["serial"], student), student
    assert processes_in(course) == [], "a process of the grading outlived the run"
