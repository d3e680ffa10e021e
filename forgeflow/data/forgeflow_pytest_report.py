"""forgeflow's pytest report plugin: the verifier's structured record of one test run.

Shipped into the sandbox by :mod:`forgeflow.sandbox.verifier` (never imported by forgeflow itself) and
loaded with ``-p forgeflow_pytest_report`` through ``PYTEST_ADDOPTS``, so it is imported before
pytest starts capturing and before any code of the repository under test runs. It then:

* writes a start line, ``FORGEFLOW-VERIFIER-STARTED-<nonce>`` (nonce from
  ``FORGEFLOW_VERIFIER_NONCE``), straight to the process's standard output: the proof that pytest
  really started with the plugin, which no later code can take back;
* at the end of the session writes the report to the path in ``FORGEFLOW_VERIFIER_REPORT``
  (outside the repository), as a Python literal (read back with ``ast.literal_eval``)::

    {"schema_version": 1, "exitstatus": int, "tests": {nodeid: status}, "collect_errors": [nodeid]}

``status`` is one of PASSED, FAILED, ERROR, SKIPPED, XFAIL, XPASS, from pytest's own reports
(``pytest_runtest_logreport``): a failure in setup or teardown is ERROR, an ``xfail`` that failed is
XFAIL, an ``xfail`` that passed (not strict) is XPASS (strict XPASS is reported failed by pytest).
Node ids are pytest's, verbatim (spaces, brackets, ``::`` and unicode in parameters included).

It imports nothing but ``os`` (frozen into the interpreter, so no file of the repository can shadow
it). Works with pytest 6 and later.
"""

import os

_REPORT_ENV = "FORGEFLOW_VERIFIER_REPORT"
_NONCE_ENV = "FORGEFLOW_VERIFIER_NONCE"
_results = {}
_collect_errors = []

if os.environ.get(_NONCE_ENV):
    os.write(1, ("\nFORGEFLOW-VERIFIER-STARTED-" + os.environ[_NONCE_ENV] + "\n").encode("ascii"))


def _status(report):
    xfail = hasattr(report, "wasxfail")
    if report.when in ("setup", "teardown"):
        if report.failed:
            return "ERROR"
        if report.skipped:
            return "XFAIL" if xfail else "SKIPPED"
        return None
    if report.passed:
        return "XPASS" if xfail else "PASSED"
    if report.skipped:
        return "XFAIL" if xfail else "SKIPPED"
    return "FAILED"


def pytest_runtest_logreport(report):
    status = _status(report)
    if status is None:
        return
    previous = _results.get(report.nodeid)
    if previous == "ERROR" or (report.when == "teardown" and status != "ERROR"):
        return  # an error in setup or teardown stands; a clean teardown changes nothing
    _results[report.nodeid] = status


def pytest_collectreport(report):
    if report.failed:
        _collect_errors.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(_REPORT_ENV)
    if not path:
        return
    payload = {"schema_version": 1, "exitstatus": int(exitstatus), "tests": dict(_results),
               "collect_errors": sorted(set(_collect_errors))}
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(repr(payload))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
