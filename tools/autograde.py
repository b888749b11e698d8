"""`make autograde A=<assignment> [COURSE=<dir>] [JOBS=<n>] [TIMEOUT=<s>] [FORCE=1]
[SCHEDULER=<address or file>]`: the students of `submitted/*/<assignment>` graded side by side,
here or on a Dask cluster, with a line of progress as each one finishes, and nothing lost when a
submission or a worker fails.

nbgrader grades one student after another in one process and says nothing until the end. Here
each student is graded by a process of its own, `nbgrader autograde <A> --student <id> --force`,
JOBS at a time, each against its own copy of the course's gradebook (taken once, at the start,
from gradebook.db). nbgrader writes the autograded notebooks into `autograded/<id>/<A>/` itself,
exactly where one-at-a-time grading writes them; the rows it writes into the copy (the
submission's timestamp, each notebook's late penalty, each grade cell's `auto_score` and
`needs_manual_grade`, each answer cell's `auto_comment`) are read back with nbgrader's API and
written into gradebook.db by this process alone, one student at a time, as they finish. Scores,
comments and autograded notebooks are therefore those of `nbgrader autograde <A> --force`.

With SCHEDULER (a Dask scheduler's address, tcp://host:8786, or the scheduler file it wrote),
each student is a task of that cluster instead, graded the same way by a worker: this module is
sent to the scheduler and the workers, which need the book's environment (nbgrader, torch) and
the course at the same path as here, on a shared file system. How many students grade at a
time is then the workers' threads, not JOBS. Dask gives the tasks of a lost worker to others.

What can go wrong with one student stays with that student:
- nbgrader fails (a file that is not a notebook, a kernel that dies): the reason is the last
  exception in its log;
- grading takes longer than TIMEOUT seconds (an answer that loops forever): nbgrader, its
  kernel and what they started are killed;
- the files that grading put beside the notebook (the book's code, the checks) are gone when it
  ends: the answers deleted them, so the grade is not trusted;
- the process is killed from outside (a worker lost): nothing of it is merged.
Each of these is reported at the end by student and reason, after every other student is
graded; the command then exits non-zero, the student keeps no autograded folder, and the next
run grades it again. A student's nbgrader log is kept in `logs/autograde/<A>/<id>.log` either
way.

A student is graded when its submission (every file of `submitted/<id>/<A>/`) or the
assignment's source (`source/<A>/`) has changed since its last grading, or it has never been
graded, or its grades or autograded folder are gone; FORCE=1 grades every student again. The
last grading of each student is recorded in `logs/autograde/<A>/graded.json`, written only after
its grades are in gradebook.db: a run stopped part way leaves the students it had not merged to
be graded by the next one, and a student merged twice overwrites its own rows (one submission
per student, as nbgrader keeps them).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import warnings

LOGS = pathlib.Path("logs") / "autograde"  # in the course folder, one folder per assignment
RECORD = "graded.json"
SNAPSHOT = "gradebook-snapshot.db"
DEFAULT_TIMEOUT = 600.0  # seconds per student: a chapter grades in seconds; this is for loops
IGNORED = ("__pycache__", ".ipynb_checkpoints")  # made by running the code, not by grading


@dataclasses.dataclass(frozen=True)
class Options:
    """How `make autograde` grades: JOBS students at a time, each for at most TIMEOUT seconds;
    FORCE grades those whose submission has not changed too; with SCHEDULER, on the workers
    of that Dask cluster (as many at a time as they have threads) instead of here."""

    jobs: int
    timeout: float
    force: bool
    scheduler: str | None = None

    @classmethod
    def from_environment(cls, environ: dict[str, str]) -> Options:
        """The options from JOBS, TIMEOUT, FORCE and SCHEDULER (the Makefile passes them; empty
        or unset means the default: every core, DEFAULT_TIMEOUT, no, this machine).
        SystemExit naming a bad value."""
        jobs = environ.get("JOBS", "").strip() or str(os.cpu_count() or 1)
        if not jobs.isdigit() or int(jobs) < 1:
            raise SystemExit(f"JOBS={jobs}: give the number of students to grade at a time, "
                             "a whole number from 1 (default: every core)")
        timeout = environ.get("TIMEOUT", "").strip() or str(DEFAULT_TIMEOUT)
        try:
            seconds = float(timeout)
        except ValueError:
            seconds = 0.0
        if not 0 < seconds < math.inf:
            raise SystemExit(f"TIMEOUT={timeout}: give the seconds one student's grading may "
                             f"take, a number above 0 (default: {DEFAULT_TIMEOUT:g})")
        force = environ.get("FORCE", "").strip().lower()
        if force not in ("", "0", "1", "no", "yes", "false", "true"):
            raise SystemExit(f"FORCE={force}: give FORCE=1 to grade every student again, or "
                             "leave it out")
        scheduler = environ.get("SCHEDULER", "").strip() or None
        if scheduler and "://" not in scheduler and not os.path.isfile(scheduler):
            raise SystemExit(f"SCHEDULER={scheduler}: give a Dask scheduler's address, such as "
                             "tcp://host:8786, or the scheduler file it wrote")
        return cls(int(jobs), seconds, force in ("1", "yes", "true"), scheduler)


# ---------------------------------------------------------------------------------------------
# One student, in a process of its own (this part runs where the grading runs)


# nbgrader started through this: on Linux it is killed when the process that started it dies
# (PR_SET_PDEATHSIG), so that a lost worker leaves no grading behind that still writes into the
# student's autograded folder.
LAUNCH = """\
import ctypes, os, runpy, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):
        sys.exit("the process that started nbgrader has ended")
sys.modules.setdefault("rfc3987_syntax", None)  # 2 s of parsers (tools/build_book.py says why)
sys.argv = ["nbgrader", *sys.argv[2:]]
runpy.run_module("nbgrader", run_name="__main__", alter_sys=True)
"""

# A kernel that lost its port to another is started again, as classroom.nbgrader does (the
# same number of tries as its PORT_RACE_TRIES; not imported, so that this module imports alone
# where a Dask worker grades).
PORT_RACE = "Address already in use"
PORT_RACE_TRIES = 3

# The nbgrader processes that local grading is running, killed with their trees when it is
# stopped. A set's add, discard and copy are atomic in CPython: threads share it without a lock.
RUNNING: set[subprocess.Popen] = set()


def process_tree(pid: int) -> list[tuple[int, int]]:
    """(pid, process group) of `pid` and every process below it, from /proc; a kernel starts a
    session of its own, so killing nbgrader's group alone would leave it running. Where there
    is no /proc, only `pid`'s own group is known."""
    parent_of, group_of = {}, {}
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the process ended while being read
            continue
        child = int(stat.parent.name)
        parent_of[child], group_of[child] = int(fields[1]), int(fields[2])
    tree, frontier = [pid], [pid]
    while frontier:
        parents = set(frontier)
        frontier = [child for child, parent in parent_of.items() if parent in parents]
        tree += frontier
    return [(p, group_of.get(p, p)) for p in tree]


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, every process below it and their process groups (never this one's)."""
    own = os.getpgrp()
    tree = process_tree(pid)
    for group in {group for _, group in tree} - {own}:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for process, _ in tree:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(process, signal.SIGKILL)


def run_nbgrader(args: list[str], course: pathlib.Path, log: pathlib.Path, timeout: float,
                 running: set | None) -> int | None:
    """`nbgrader <args>` in `course`, its output in `log`; its exit status, or None if it took
    longer than `timeout` seconds (then it and everything it started are killed). While it
    runs, its Popen is in `running` (if given)."""
    bin_dir = pathlib.Path(sys.executable).parent  # nbgrader starts this environment's alembic
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(os.getpid()), *args],
                                cwd=course, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    if running is not None:
        running.add(proc)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        return None
    finally:
        if running is not None:
            running.discard(proc)


def failure_reason(log: str, status: int) -> str:
    """Why nbgrader failed, from its log: the last exception it reports, else its last error."""
    exceptions = re.findall(r"^\s*(?:\w+\.)*(\w*(?:Error|Exception|Exit)\w*)(?:: (.*))?$",
                            log, re.M)
    if exceptions:
        name, message = exceptions[-1]
        reason = f"{name}: {message}" if message else name
    else:
        errors = re.findall(r"^\[\w+ \| ERROR\] (.*)$", log, re.M)
        reason = errors[-1] if errors else f"nbgrader exited with status {status}"
    return "nbgrader stopped on " + (reason if len(reason) <= 300 else reason[:297] + "...")


def files_below(folder: pathlib.Path) -> list[pathlib.Path]:
    """Every file below `folder`, as paths relative to it, sorted; none from IGNORED folders."""
    return sorted(path.relative_to(folder) for path in folder.rglob("*")
                  if path.is_file() and not set(path.relative_to(folder).parts) & set(IGNORED))


def submission_rows(db_url: str, assignment: str, student: str) -> dict:
    """What nbgrader's autograde writes for one student, read from a gradebook with nbgrader's
    API, as plain data: the submission's timestamp and, per notebook, its late penalty, each
    grade cell's auto_score and needs_manual_grade, and each answer cell's auto_comment."""
    from nbgrader.api import Gradebook

    with Gradebook(db_url) as gradebook:
        submission = gradebook.find_submission(assignment, student)
        return {
            "timestamp": submission.timestamp.isoformat() if submission.timestamp else None,
            "notebooks": {
                notebook.name: {
                    "late_submission_penalty": notebook.late_submission_penalty,
                    "grades": {grade.name: [grade.auto_score, grade.needs_manual_grade]
                               for grade in notebook.grades},
                    "comments": {comment.name: comment.auto_comment
                                 for comment in notebook.comments}}
                for notebook in submission.notebooks}}


def grade_student(course: str, assignment: str, student: str, snapshot: str, timeout: float,
                  running: set | None = None) -> dict:
    """Grade one student with `nbgrader autograde <assignment> --student <student> --force`
    against a copy of `snapshot` (the course's gradebook at the start of the run) in a temporary
    folder; `running` as for run_nbgrader. The same here and on a Dask worker, which is sent
    this module (graded_on_cluster), so that it needs the book's environment and the course's
    folder but not this repository. Returns {"student", "log": nbgrader's output, "rows":
    submission_rows of the copy or None, "failure": None or why the grading is not to be
    trusted}."""
    root = pathlib.Path(course)
    graded = root / "autograded" / student / assignment
    supplied = [path for path in files_below(root / "source" / assignment)
                if path.suffix != ".ipynb"]  # what autograde copies beside the notebooks
    rows = failure = None
    with tempfile.TemporaryDirectory(prefix="autograde-") as tmp:
        copy, log = pathlib.Path(tmp) / "gradebook.db", pathlib.Path(tmp) / "nbgrader.log"
        for _ in range(PORT_RACE_TRIES):
            shutil.copyfile(snapshot, copy)
            status = run_nbgrader(["autograde", assignment, "--student", student, "--force",
                                   f"--CourseDirectory.db_url=sqlite:///{copy}"],
                                  root, log, timeout, running)
            text = log.read_text(errors="replace")
            if status == 0 or PORT_RACE not in text:
                break
        if status is None:
            failure = (f"took longer than TIMEOUT={timeout:g} s; nbgrader and its kernel "
                       "were killed")
            text += f"\n[make autograde] {failure}\n"
        elif status < 0:
            failure = f"nbgrader was killed ({signal.Signals(-status).name})"
        elif status != 0:
            failure = failure_reason(text, status)
        else:
            missing = [str(path) for path in supplied if not (graded / path).is_file()]
            if missing:
                failure = ("deleted files of its folder while being graded: "
                           + ", ".join(missing[:5])
                           + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
            else:
                rows = submission_rows(f"sqlite:///{copy}", assignment, student)
    return {"student": student, "log": text, "rows": rows, "failure": failure}


# ---------------------------------------------------------------------------------------------
# The run: what to grade, the workers, the merge (this part runs in `make autograde`)


def fingerprint(folder: pathlib.Path) -> str:
    """SHA-256 of every file below `folder`: names and contents."""
    digest = hashlib.sha256()
    for path in files_below(folder):
        digest.update(f"{path.as_posix()}\0".encode())
        digest.update(hashlib.sha256((folder / path).read_bytes()).digest())
    return digest.hexdigest()


def to_grade(course: pathlib.Path, assignment: str, students: list[str],
             in_gradebook: set[str], record: dict[str, dict], force: bool) -> dict[str, dict]:
    """{student: what the record will hold once it is graded} for the students to grade: all
    if `force`, else those that `record` (graded.json) has not seen with this submission and
    this source, or with no submission in the gradebook or no autograded folder."""
    source = fingerprint(course / "source" / assignment)
    pending = {}
    for student in students:
        entry = {"submission": fingerprint(course / "submitted" / student / assignment),
                 "source": source}
        if (force or record.get(student) != entry or student not in in_gradebook
                or not (course / "autograded" / student / assignment).is_dir()):
            pending[student] = entry
    return pending


def merge(gradebook, assignment: str, student: str, rows: dict) -> None:
    """Write one student's rows (submission_rows) into `gradebook` (an open
    nbgrader.api.Gradebook), as nbgrader's autograde would have: the student and submission
    made if new, the autograder's fields set, the grader's own (manual scores and comments,
    extra credit, flags) left as they are. ValueError if the assignment's cells differ."""
    from nbgrader.api import MissingEntry
    from sqlalchemy.exc import SAWarning

    gradebook.update_or_create_student(student)
    with warnings.catch_warnings():  # nbgrader's add_submission builds rows outside its session
        warnings.filterwarnings("ignore", "Object of type .* not in session", SAWarning)
        gradebook.update_or_create_submission(assignment, student, timestamp=rows["timestamp"])
    for name, notebook_rows in rows["notebooks"].items():
        try:
            notebook = gradebook.find_submission_notebook(name, assignment, student)
        except MissingEntry:
            notebook = None
        if notebook is None or {g.name for g in notebook.grades} != set(notebook_rows["grades"]) \
                or {c.name for c in notebook.comments} != set(notebook_rows["comments"]):
            gradebook.db.rollback()
            raise ValueError(f"{name} in gradebook.db changed while it was graded (released "
                             "again?)")
        grades = {grade.name: grade for grade in notebook.grades}
        comments = {comment.name: comment for comment in notebook.comments}
        notebook.late_submission_penalty = notebook_rows["late_submission_penalty"]
        for grade_name, (auto_score, needs_manual_grade) in notebook_rows["grades"].items():
            grades[grade_name].auto_score = auto_score
            grades[grade_name].needs_manual_grade = needs_manual_grade
        for comment_name, auto_comment in notebook_rows["comments"].items():
            comments[comment_name].auto_comment = auto_comment
    gradebook.db.commit()


def duration(seconds: float) -> str:
    """Seconds as m:ss, or h:mm:ss from an hour."""
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02}:{seconds:02}" if hours else f"{minutes}:{seconds:02}"


@contextlib.contextmanager
def course_lock(logs: pathlib.Path):
    """Hold the course's autograde lock: one run at a time writes its gradebook."""
    import fcntl

    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SystemExit(f"another `make autograde` is grading in {logs.parent.parent}: "
                             "wait for it to end") from None
        yield


def snapshot_of(gradebook: pathlib.Path, target: pathlib.Path) -> None:
    """A consistent copy of an SQLite database (SQLite's online backup)."""
    target.unlink(missing_ok=True)
    with contextlib.closing(sqlite3.connect(gradebook)) as source, \
            contextlib.closing(sqlite3.connect(target)) as copy:
        source.backup(copy)


def write_json(path: pathlib.Path, data: dict) -> None:
    """Replace `path` with `data` as JSON in one step (a stopped run leaves the old or new)."""
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(partial, path)


def graded_locally(course: pathlib.Path, assignment: str, students: list[str],
                   snapshot: pathlib.Path, options: Options):
    """grade_student's results for `students`, in the order they finish, options.jobs at a
    time in processes on this machine. Stopped (Ctrl-C), it kills the gradings under way and,
    as nbgrader does with a grading it stops, removes their autograded folders."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=options.jobs) as pool:
        futures = {pool.submit(grade_student, str(course), assignment, student, str(snapshot),
                               options.timeout, RUNNING): student for student in students}
        handed_over = set()
        try:
            for future in concurrent.futures.as_completed(futures):
                handed_over.add(futures[future])
                yield future.result()
        finally:
            begun = [student for future, student in futures.items()
                     if not future.cancel() and student not in handed_over]
            for proc in RUNNING.copy():
                kill_tree(proc.pid)
            for student in begun:
                shutil.rmtree(course / "autograded" / student / assignment, ignore_errors=True)


def dask_client(scheduler: str):
    """A client of the Dask cluster whose scheduler is at `scheduler`, an address
    (tcp://host:8786) or a scheduler file; SystemExit saying why if there is none."""
    import distributed

    where = ({"address": scheduler} if "://" in scheduler
             else {"scheduler_file": scheduler})
    try:
        return distributed.Client(**where, timeout=30)
    except (OSError, TimeoutError, ValueError) as error:
        raise SystemExit(f"SCHEDULER={scheduler}: no Dask scheduler answers there "
                         f"({type(error).__name__}: {error})") from None


def graded_on_cluster(course: pathlib.Path, assignment: str, students: list[str],
                      snapshot: pathlib.Path, options: Options):
    """grade_student's results for `students`, in the order they finish, each a task on the
    Dask cluster of options.scheduler, whose workers read the course at the same path as here.
    Dask gives a lost worker's tasks to the others; a student whose tasks lost too many workers
    (Dask's allowed-failures) comes back as a failure. Stopped, it cancels the tasks not begun
    (those under way end within TIMEOUT)."""
    import distributed

    client = dask_client(options.scheduler)
    futures = {}
    try:
        client.upload_file(__file__)  # to the scheduler and every worker, imported there
        futures = {client.submit(grade_student, str(course), assignment, student, str(snapshot),
                                 options.timeout, key=f"autograde-{assignment}-{student}-"
                                 f"{os.urandom(4).hex()}"): student for student in students}
        for future in distributed.as_completed(futures):
            try:
                yield future.result()
            except Exception as error:  # the task's worker died too often, or it was cancelled
                yield {"student": futures[future], "log": "", "rows": None,
                       "failure": f"the cluster could not grade it ({type(error).__name__}: "
                                  f"{error})"}
    finally:
        client.cancel(list(futures))
        client.close()


def flagged_answers(course: pathlib.Path, assignment: str, students) -> dict[str, list[str]]:
    """{student: flags} from the reports that isolated grading writes beside each autograded
    notebook (its scan found the grading's machinery or introspection in an answer cell)."""
    import isolated_grading

    flagged = {}
    for student in sorted(students):
        for report in sorted((course / "autograded" / student / assignment).glob(
                f"*{isolated_grading.REPORT_SUFFIX}")):
            flags = json.loads(report.read_text()).get("flags") or []
            flagged.setdefault(student, []).extend(flags)
    return {student: flags for student, flags in flagged.items() if flags}


def run(course: pathlib.Path, assignment: str, options: Options, say=print) -> str:
    """`make autograde`: grade the students of `course` that need it (see the module's
    docstring), `say` a line as each finishes, return the summary; SystemExit with the summary
    and the failures, by student and reason, if any student failed."""
    course = course.resolve()
    students = sorted(p.parent.name for p in course.glob(f"submitted/*/{assignment}")
                      if p.is_dir())
    if not students:
        raise SystemExit(f"no submissions: put each student's folder in "
                         f"{course}/submitted/<student-id>/{assignment}/")
    database = course / "gradebook.db"
    url = f"sqlite:///{database}"
    if not database.is_file():
        raise SystemExit(f"{course} has no gradebook.db yet: run `make release A={assignment}` "
                         "first")
    from nbgrader.api import Gradebook, MissingEntry  # seconds to import: after the checks

    logs = course / LOGS / assignment
    with course_lock(course / LOGS), Gradebook(url) as gradebook:
        try:
            tests = {(notebook.name, cell.name): cell.max_score
                     for notebook in gradebook.find_assignment(assignment).notebooks
                     for cell in notebook.grade_cells
                     if cell.name not in {s.name for s in notebook.solution_cells}}
            by_hand = gradebook.find_assignment(assignment).max_score - sum(tests.values())
        except MissingEntry:
            raise SystemExit(f"{assignment} is not in {database}: run "
                             f"`make release A={assignment}` first") from None
        record_path = logs / RECORD
        record = json.loads(record_path.read_text()) if record_path.is_file() else {}
        in_gradebook = {s.student.id for s in gradebook.assignment_submissions(assignment)}
        pending = to_grade(course, assignment, students, in_gradebook, record, options.force)
        if not pending:
            return (f"{assignment}: nothing new to grade: {len(students)} submission"
                    f"{'s' * (len(students) != 1)} unchanged since their last grading "
                    "(FORCE=1 grades them again)")
        grading = graded_on_cluster if options.scheduler else graded_locally
        where = (f"on the Dask cluster at {options.scheduler}" if options.scheduler
                 else f"{min(options.jobs, len(pending))} at a time")
        say(f"{assignment}: grading {len(pending)} of {len(students)} submissions, {where}")
        failures: dict[str, str] = {}

        def settle(outcome: dict) -> str:
            """Keep one student's log; merge its rows and record it, or note its failure and
            remove its autograded folder; the result for its progress line."""
            student, failure = outcome["student"], outcome["failure"]
            (logs / f"{student}.log").write_text(outcome["log"])
            if failure is None:
                try:
                    merge(gradebook, assignment, student, outcome["rows"])
                except ValueError as error:
                    failure = str(error)
            if failure is not None:
                failures[student] = failure
                record.pop(student, None)
                write_json(record_path, record)
                shutil.rmtree(course / "autograded" / student / assignment, ignore_errors=True)
                return f"not graded: {failure}"
            record[student] = pending[student]
            write_json(record_path, record)
            notebooks = outcome["rows"]["notebooks"]
            got = sum(notebooks[notebook]["grades"][cell][0] or 0 for notebook, cell in tests)
            return f"{got:g} of {sum(tests.values()):g} points"

        logs.mkdir(parents=True, exist_ok=True)
        snapshot = logs / SNAPSHOT
        snapshot_of(database, snapshot)
        started = time.perf_counter()
        try:
            with contextlib.closing(grading(course, assignment, list(pending), snapshot,
                                            options)) as outcomes:
                for done, outcome in enumerate(outcomes, 1):
                    result = settle(outcome)
                    rate = done / (time.perf_counter() - started) * 60
                    say(f"{done}/{len(pending)} {outcome['student']}: {result} ({rate:.1f} "
                        f"students/min, {duration((len(pending) - done) / rate * 60)} left)")
        finally:
            snapshot.unlink(missing_ok=True)
    elapsed = time.perf_counter() - started
    graded = len(pending) - len(failures)
    lines = [f"{assignment}: {graded} of {len(pending)} submissions graded in "
             f"{duration(elapsed)} ({len(pending) / elapsed * 60:.1f} students/min); "
             f"nbgrader's logs in {logs}"]
    if by_hand:
        lines.append(f"  and {by_hand:g} points each to grade by hand (nbgrader's formgrader)")
    flagged = flagged_answers(course, assignment, [o for o in pending if o not in failures])
    if flagged:
        lines.append(f"{len(flagged)} flagged by the grading's scan (no points for their "
                     "autograded cases; look at them):")
        lines += [f"  {student}: {flag}" for student, flags in flagged.items() for flag in flags]
    if failures:
        lines.append(f"{len(failures)} failed, to be graded again on the next run:")
        lines += [f"  {student}: {reason}" for student, reason in sorted(failures.items())]
        raise SystemExit("\n".join(lines))
    return "\n".join(lines)
