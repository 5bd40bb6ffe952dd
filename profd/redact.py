"""Keeping the ``user:password@`` of URLs out of what profd logs, stores and reports.

S3-compatible stores are often written down as ``http://user:password@host:port``. boto3
never uses that userinfo (credentials come from its standard chain), but botocore and urllib3
name the endpoint URL in their errors, and those errors end up in ``profctl status``, in
``last_error`` in the index and in the daemon log.
"""

from __future__ import annotations

import logging
import re

REDACTED = "***"

# The authority of a URL ends at the first "/", "?" or "#" (RFC 3986), and urlsplit takes
# the host from after its *last* "@", so a password with an unencoded "@" is still hidden
# whole. Whitespace, quotes and brackets also end it: in prose and in reprs the URL is
# delimited by them, and "[" starts an IPv6 host, which never precedes userinfo. The scheme's
# length is bounded so that a long run of letters with no "://" costs linear time, not
# quadratic (a longer scheme still matches by its tail, and its userinfo is still hidden).
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]{0,31}://)[^\s/?#\"'<>\[\]\\]*@")


def redact_url(text: str) -> str:
    """``text`` with the userinfo of every URL in it replaced by ``***``."""
    if "@" not in text or "://" not in text:
        return text  # the common case, on every log record of the S3 loggers
    return _USERINFO.sub(rf"\g<scheme>{REDACTED}@", text)


def strip_userinfo(url: str) -> str:
    """``url`` without its userinfo, for handing to a library that would connect to it.

    Splits the way urlsplit does, so the host kept is the one a client would have used."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    authority = rest[:end]
    if "@" not in authority:
        return url
    return f"{scheme}://{authority.rpartition('@')[2]}{rest[end:]}"


class RedactFilter(logging.Filter):
    """Redacts URLs in a record's message and traceback before any handler formats it.

    A logger's filters see only the records made by that logger, so it goes on each logger
    whose records may carry an endpoint URL, not on a parent."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = redact_url(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            # Formatters reuse exc_text when it is set, so the traceback they print is this one.
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_url(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_url(record.stack_info)
        return True
