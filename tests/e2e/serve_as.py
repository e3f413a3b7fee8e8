"""``python -m tests.e2e.serve_as USER serve --config PATH``: the daemon as another user.

Everything is imported and the config read as root; then the process drops to USER
and serves, with the CLI's error handling (one line, exit 2 for a bad setting).
"""

import sys

from kvxfer.core.errors import InvalidArgument, KvxferError
from service import config, server
from tests.e2e.attacker import drop_to

if __name__ == "__main__":
    user, _serve, _flag, path = sys.argv[1:5]
    cfg = config.load(path)
    drop_to(user)
    try:
        sys.exit(server.serve(cfg))
    except InvalidArgument as exc:
        print(f"kvxfer serve: {exc}", file=sys.stderr)
        sys.exit(2)
    except KvxferError as exc:
        print(f"kvxfer serve: {exc}", file=sys.stderr)
        sys.exit(1)
