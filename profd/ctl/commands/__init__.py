"""One module per profctl command. ``COMMANDS`` maps each name to ``module:attribute``; a
command's module is imported only when that command runs, which keeps ``profctl ps`` fast."""

from __future__ import annotations

COMMANDS: dict[str, str] = {
    "status": "status:status",
    "ps": "ps:ps",
    "top": "top:top",
    "start": "start:start",
    "stop": "stop:stop",
    "cancel": "stop:cancel",
    "sessions": "sessions:sessions",
    "show": "sessions:show",
    "traces": "traces:traces",
    "history": "history:history",
    "incidents": "incidents:incidents",
    "incident": "incidents:incident",
    "stacks": "stacks:stacks",
    "blackbox": "blackbox:blackbox",
    "pull": "pull:pull",
    "retry": "retry:retry",
    "run": "run:run",
    "keys": "keys:keys",
    "report": "report:report",
    "diff": "report:diff",
    "query": "warehouse:query",
    "goodput": "warehouse:goodput",
    "nodes": "warehouse:nodes",
    "trend": "warehouse:trend",
}
