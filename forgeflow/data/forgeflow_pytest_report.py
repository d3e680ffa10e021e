"""forgeflow's pytest report plugin: the verifier's record of one test run, streamed as it happens.

Shipped into the sandbox by :mod:`forgeflow.sandbox.verifier` (never imported by forgeflow) and loaded
with ``-p forgeflow_pytest_report`` through ``PYTEST_ADDOPTS``: imported before pytest captures output
and before any code under test runs. At import it takes its settings from the environment (and removes
them, so a nested pytest stays silent) and a private ``os.dup`` of ``FORGEFLOW_VERIFIER_FD`` (fd 1
without it), on which it writes one record per event as the event happens::

    \\n@forgeflow-verifier-<nonce> {"seq": 0, "kind": "start", ...}\\n

A pipe is append-only, so the reader (:mod:`forgeflow.sandbox.verifier_channel`) can tell a forgery
(a second outcome, a record after the end, an outcome of a test never collected) from the run. Kinds:
``start`` (pid, ``sys_path``, ``modules`` already imported, pytest's version); ``distributed`` (under
pytest-xdist: refused); ``deselected``; ``collect`` (a failed or skipped collector); ``inputs`` (ini,
rootdir, args, plugins, conftests, entry points, hook files); ``collected`` (ids in run order);
``registered`` (a plugin registered later, its hook files, whether collection had started);
``report`` (``nodeid``, ``when``, ``outcome``, ``xfail``, ``rep``, ``duration_s``); ``integrity``
(hook implementations or pytest's reporting functions replaced since import); ``end`` (``exitstatus``,
``verbosity``).

Tripwires: ``FORGEFLOW_VERIFIER_TRIPWIRES`` names a test file whose tests (one must pass, one must fail)
are appended after every selection, so a hook forcing every outcome cannot keep both right.
Repeats (flaky-gold detection): ``FORGEFLOW_VERIFIER_SELECT`` names node ids that run
``FORGEFLOW_VERIFIER_REPEAT`` times through ``_pytest.runner.runtestprotocol`` (as
pytest-rerunfailures does), tagged ``rep``; ``FORGEFLOW_VERIFIER_ONLY_SELECTED=1`` deselects the rest.

It imports only ``os`` and ``sys`` (frozen or built in, so no repository file can shadow them) and
pytest's own modules, and writes JSON itself rather than with the ``json`` module. pytest 7 and later.
"""

import os
import sys

import pytest

_PREFIX = "@forgeflow-verifier-"
_WRITE = os.write  # taken before any repository code runs: a later os.write replaced changes nothing here
_NONCE = os.environ.pop("FORGEFLOW_VERIFIER_NONCE", "")
_FD_TEXT = os.environ.pop("FORGEFLOW_VERIFIER_FD", "")
_TRIPWIRES = os.environ.pop("FORGEFLOW_VERIFIER_TRIPWIRES", "")
_SELECT = os.environ.pop("FORGEFLOW_VERIFIER_SELECT", "")
_REPEAT_TEXT = os.environ.pop("FORGEFLOW_VERIFIER_REPEAT", "")
_ONLY_SELECTED = os.environ.pop("FORGEFLOW_VERIFIER_ONLY_SELECTED", "") == "1"


def _json(value):
    """``value`` (str, int, bool, None, list, tuple, dict with str keys) as one line of ASCII JSON."""
    if value is None or value is True or value is False:
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return repr(value) if value - value == 0 else "null"  # finite floats only
    if isinstance(value, str):
        out = ['"']
        for ch in value:
            code = ord(ch)
            if ch in '"\\':
                out.append("\\" + ch)
            elif 0x20 <= code < 0x7F:
                out.append(ch)
            elif code < 0x10000:
                out.append("\\u%04x" % code)
            else:
                code -= 0x10000
                out.append("\\u%04x\\u%04x" % (0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF)))
        out.append('"')
        return "".join(out)
    if isinstance(value, dict):
        return "{" + ", ".join(_json(str(k)) + ": " + _json(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_json(v) for v in value) + "]"
    return _json(str(value))


class _Channel:
    """The private descriptor and the record counter (``__slots__``: no attribute of an instance can
    stand in for :meth:`emit`, which the hooks call as the function taken at import, ``_EMIT``)."""

    __slots__ = ("prefix", "fd", "seq")

    def __init__(self, nonce, source_fd):
        self.prefix = "\n" + _PREFIX + nonce + " "
        self.fd = os.dup(source_fd)
        self.seq = 0

    def emit(self, kind, **fields):
        data = (self.prefix + _json({"seq": self.seq, "kind": kind, **fields}) + "\n").encode("ascii")
        self.seq += 1
        while data:
            data = data[_WRITE(self.fd, data):]


_EMIT = _Channel.emit


def _hook_files(plugin):
    """The source files of ``plugin``'s hook functions (``pytest_*``), by their code objects: where the code
    that pytest calls lives, whatever the plugin's ``__module__`` claims."""
    files = set()
    for name in dir(plugin):
        if name.startswith("pytest_"):
            try:
                function = getattr(plugin, name)
            except Exception:
                continue
            code = getattr(getattr(function, "__func__", function), "__code__", None)
            if code is not None and isinstance(code.co_filename, str):
                files.add(code.co_filename)
    return sorted(files)


def _file_of(obj):
    path = getattr(obj, "__file__", None)
    if path is None:
        path = getattr(sys.modules.get(getattr(type(obj), "__module__", ""), None), "__file__", None)
    return path if isinstance(path, str) else None


_CHANNEL = None
if _NONCE:
    _source = int(_FD_TEXT) if _FD_TEXT.isdigit() else 1
    _CHANNEL = _Channel(_NONCE, _source)
    if _source != 1:
        os.close(_source)  # the private duplicate stays; children of the tests do not get the wrapper's copy
    _EMIT(_CHANNEL, "start", pid=os.getpid(), sys_path=list(sys.path),
                  modules={name: _file_of(m) for name, m in sorted(sys.modules.items()) if _file_of(m)},
                  pytest=getattr(pytest, "__version__", None))


def _hook_callers(manager):
    """Every hook caller of ``manager`` (pluggy's ``HookCaller`` objects on ``manager.hook``)."""
    return [caller for caller in vars(manager.hook).values() if hasattr(caller, "get_hookimpls")]


def _replaced(watched, extra=()):
    """Names of the watched functions no longer the ones taken at import (replaced in the process)."""
    out = [f"{getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{name}"
           for owner, name, original in [*watched, *extra] if vars(owner).get(name) is not original]
    return sorted(out)


class _Reporter:
    """The hooks of the one pytest session this process reports (a pytest run inside a test, e.g.
    ``pytester``'s in-process runs, registers its own config and is not reported)."""

    def __init__(self, config, channel):
        self.config, self.channel = config, channel
        self.rep = 0
        self.repeat = int(_REPEAT_TEXT) if _REPEAT_TEXT.isdigit() and int(_REPEAT_TEXT) > 1 else 1
        self.tripwires = set()
        self.selected = set()
        self.flagged = set()
        self.hookexec = vars(config.pluginmanager).get("_inner_hookexec")
        self.live = False  # set once registered: the historic replay of earlier registrations is not recorded
        self.collecting = False  # set when collection starts: code under test runs from then on
        self.impls = {}  # id(HookImpl) -> (the HookImpl, its function): every implementation a registration added
        dist = getattr(config.option, "dist", None)  # pytest-xdist's mode, set from -n before configure
        if dist not in (None, "no"):
            _EMIT(channel, "distributed", dist=str(dist), workers=str(getattr(config.option, "numprocesses", None)))

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_collection_modifyitems(self, session, config, items):
        yield  # every other selection first
        if _SELECT:
            with open(_SELECT, encoding="utf-8") as handle:
                self.selected = set(handle.read().splitlines())
            dropped = [item for item in items if item.nodeid not in self.selected]
            if dropped and _ONLY_SELECTED:
                config.hook.pytest_deselected(items=dropped)
                items[:] = [item for item in items if item.nodeid in self.selected]
        if _TRIPWIRES and os.path.isfile(_TRIPWIRES):
            import pathlib

            module = pytest.Module.from_parent(session, path=pathlib.Path(_TRIPWIRES))
            wires = list(session.genitems(module))
            self.tripwires.update(item.nodeid for item in wires)
            items.extend(wires)

    def learn_impls(self, plugin=None):
        """Note the hook implementations registration added (of ``plugin``; None: of every plugin so far),
        each with its function: the integrity check's baseline (:meth:`_integrity`)."""
        for caller in _hook_callers(self.config.pluginmanager):
            for impl in caller.get_hookimpls():
                if plugin is None or impl.plugin is plugin:
                    self.impls.setdefault(id(impl), (impl, impl.function))

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session):
        self.collecting = True

    def pytest_plugin_registered(self, plugin, manager):
        """Every plugin registered after this reporter (by a conftest, or by code under test, at any time:
        one registered and removed again between two tests is recorded too), with its hook functions' files,
        whether it is a conftest module, and whether collection (code under test) had started."""
        if self.live:
            self.learn_impls(plugin)
            _EMIT(self.channel, "registered", name=str(manager.get_name(plugin)), file=_file_of(plugin),
                  hook_files=_hook_files(plugin), collecting=self.collecting,
                  conftest=plugin in getattr(manager, "_conftest_plugins", ()))

    def pytest_deselected(self, items):
        _EMIT(self.channel, "deselected", ids=[item.nodeid for item in items])

    def pytest_collectreport(self, report):
        if report.failed or report.skipped:
            _EMIT(self.channel, "collect", nodeid=report.nodeid, outcome=report.outcome)

    def pytest_collection_finish(self, session):
        config = self.config
        manager = config.pluginmanager
        plugins = {str(name): _file_of(plugin) for name, plugin in manager.list_name_plugin() if plugin is not None}
        conftests = sorted({_file_of(mod) for mod in getattr(manager, "_conftest_plugins", ()) if _file_of(mod)})
        entry_points = [{"plugin": _file_of(plugin), "dist": str(getattr(dist, "_path", None) or dist)}
                        for plugin, dist in manager.list_plugin_distinfo()]
        inipath = getattr(config, "inipath", None)
        hook_files = sorted({f for _, plugin in manager.list_name_plugin() if plugin is not None
                             for f in _hook_files(plugin)})
        _EMIT(self.channel, "inputs", inipath=str(inipath) if inipath else None, rootpath=str(config.rootpath),
              args=[str(a) for a in config.invocation_params.args], plugins=plugins,
              conftests=conftests, entry_points=entry_points, hook_files=hook_files)
        _EMIT(self.channel, "collected", ids=[item.nodeid for item in session.items])

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        if self.repeat == 1 or item.nodeid not in self.selected:
            return None
        from _pytest.runner import runtestprotocol

        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for rep in range(self.repeat):
            self.rep = rep
            runtestprotocol(item, nextitem=nextitem, log=True)
        self.rep = 0
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    def _integrity(self, _callers=_hook_callers, _replaced=_replaced):  # bound here: a later rebinding of the
        # module's names changes nothing
        """Emit an ``integrity`` record naming the pytest functions replaced since the plugin's import, and
        the hook implementations no registration added or whose function was swapped since (once per new
        name): code in the test process that patched how outcomes are built or reported."""
        manager = self.config.pluginmanager
        extra = [(manager, "_inner_hookexec", self.hookexec)] if self.hookexec is not None else []
        found = _replaced(_WATCHED, extra)
        for caller in _callers(manager):
            for impl in caller.get_hookimpls():
                known = self.impls.get(id(impl))
                if known is None or known[0] is not impl:
                    found.append(f"{caller.name}: an implementation added without registering a plugin")
                elif impl.function is not known[1]:
                    found.append(f"{caller.name}: an implementation's function swapped")
        bad = [name for name in dict.fromkeys(found) if name not in self.flagged]
        if bad:
            self.flagged.update(bad)
            _EMIT(self.channel, "integrity", replaced=bad)

    def pytest_runtest_logreport(self, report):
        self._integrity()
        _EMIT(self.channel, "report", nodeid=report.nodeid, when=report.when, outcome=report.outcome,
                          xfail=hasattr(report, "wasxfail"), rep=self.rep, duration_s=float(report.duration))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        self._integrity()
        _EMIT(self.channel, "end", exitstatus=int(exitstatus), verbosity=int(getattr(self.config.option, "verbose", 0)))


def _watch_list():
    """The functions pytest builds and reports outcomes with, each as (owner, name, the object found now):
    taken at the plugin's import, before any repository code runs (integrity check, see :func:`_replaced`)."""
    import _pytest.python
    import _pytest.reports
    import _pytest.runner
    import _pytest.terminal
    import pluggy._hooks

    hook_caller = getattr(pluggy._hooks, "HookCaller", None) or getattr(pluggy._hooks, "_HookCaller", None)
    hook_impl = getattr(pluggy._hooks, "HookImpl", None)
    owners = ((_pytest.reports.TestReport, ("from_item_and_call", "__init__", "_to_json", "_from_json")),
              (_pytest.runner, ("call_and_report", "call_runtest_hook", "runtestprotocol", "pytest_runtest_makereport",
                                "check_interactive_exception", "show_test_item")),
              (_pytest.runner.CallInfo, ("from_call",)), (_pytest.python.Function, ("runtest",)),
              (_pytest.python, ("pytest_pyfunc_call",)), (_pytest.terminal.TerminalReporter,
                                                          ("pytest_runtest_logreport", "summary_stats")),
              (_Channel, ("emit",)), (_Reporter, ("pytest_runtest_logreport", "pytest_sessionfinish",
                                                   "pytest_plugin_registered", "learn_impls", "_integrity")),
              (hook_caller, ("__call__", "call_historic", "_hookexec", "get_hookimpls", "_add_hookimpl")),
              (hook_impl, ("__init__",)))
    return tuple((owner, name, vars(owner)[name]) for owner, names in owners if owner is not None
                 for name in names if name in vars(owner))


def pytest_configure(config):
    """Register the reporter for the first config of this process (the session the verifier runs)."""
    global _CHANNEL
    if _CHANNEL is not None:
        channel, _CHANNEL = _CHANNEL, None
        reporter = _Reporter(config, channel)
        config.pluginmanager.register(reporter, "forgeflow-verifier-reporter")
        reporter.learn_impls()
        reporter.live = True


_WATCHED = _watch_list() if _NONCE else ()
