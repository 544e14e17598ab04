"""One base class for every error snakellm reports, and the exit status each kind means.

A step that fails raises a :class:`SnakellmError` subclass; ``snakellm <step>``
(:mod:`snakellm.cli`) prints its message on one line and exits with its
``exit_code``, so a rule, a Slurm job or a person sees the same contract:

* 2 (:class:`UsageError`, :class:`ConfigError`): the request itself is wrong (a
  bad flag, a bad config key, a missing input named on the command line);
  nothing was done.
* 1 (:class:`StepFailed` and the per-stage subclasses): the step started and
  failed while working (bad data, a damaged shard, a failed job).
* 75 (:class:`StopToResume`, EX_TEMPFAIL): a clean stop that a rerun resumes
  (a time limit or a signal); Snakemake's ``retries`` rerun the job.

Per-stage classes subclass one of these; they may also subclass a builtin
(``ValueError``) where callers and tests already catch that.
"""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_RESUME = 75


class SnakellmError(Exception):
    """Base of every snakellm error; ``exit_code`` is what ``snakellm <step>`` exits with."""

    exit_code: int = EXIT_FAILED


class UsageError(SnakellmError):
    """A bad command line or request: nothing was done (exit status 2)."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError, ValueError):
    """A config problem, phrased for the person who wrote the config (exit status 2)."""


class StepFailed(SnakellmError):
    """A step failed while working: bad data, a failed job (exit status 1)."""

    exit_code = EXIT_FAILED


class DataError(StepFailed, ValueError):
    """Input data that cannot be used: the message names the file, line and reason (exit status 1)."""


class StopToResume(SnakellmError):
    """A clean stop (checkpoint written) that a rerun resumes (exit status 75)."""

    exit_code = EXIT_RESUME
