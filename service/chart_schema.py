"""The chart's schema for ``kvxfer.config`` from the daemon's own key lists.

A key the daemon does not know (a typo under ``kvxfer.config``) used to render, deploy and end
in CrashLoopBackOff; the schema now names every key the daemon reads, top level and in each
section, and refuses others at ``helm install``/``helm lint``. The entries the chart constrains
further (types, what the chart sets itself) are kept as written; a key without one accepts
any value there, and the daemon validates it at start. ``make chart-schema`` rewrites the
file; the tests fail when it is stale.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvxfer.tiers.registry import LOWER_TIERS
from kvxfer.tiers.sections import RENAMED
from service import config, config_peering, config_sections

SCHEMA = Path(__file__).resolve().parents[1] / "helm" / "kvxfer" / "values.schema.json"


def daemon_keys() -> dict[str, set[str] | None]:
    """Each top-level key the daemon reads, with its section's keys (None: a scalar or the pools' list); a
    renamed key (``kvxfer.tiers.sections.RENAMED``) is read still, so the schema takes it too."""
    keys: dict[str, set[str] | None] = {name: None for name in config._SCALARS}
    keys["pools"] = None  # (its items are described in full by the schema already)
    keys["tenants"] = None  # (a list: the daemon validates its items)
    keys["events"] = set(config_sections.EVENTS_KEYS)
    keys["admission"] = set(config_sections.ADMISSION_KEYS)
    keys["hints"] = set(config_sections.HINTS_KEYS)
    keys["peering"] = set(config_peering.PEERING_KEYS)
    for row in LOWER_TIERS:
        if row.parse is not None:
            keys[row.section] = set(row.keys)
    for section, old in RENAMED:
        keys[section] = {*keys[section], old}
    return keys


def updated(schema: dict) -> dict:
    """``schema`` with kvxfer.config closed over the daemon's keys (a copy; what was written is kept)."""
    schema = json.loads(json.dumps(schema))
    node = schema["properties"]["kvxfer"]["properties"]["config"]
    properties = node.setdefault("properties", {})
    for key, section in sorted(daemon_keys().items()):
        entry = properties.setdefault(key, {} if section is None else {"type": "object"})
        if section is not None and "not" not in entry:
            fields = entry.setdefault("properties", {})
            for name in sorted(section - set(fields)):
                fields[name] = next(({"description": f"renamed {new} (in MiB): read as it"}
                                     for (where, old), (new, _) in RENAMED.items() if (where, old) == (key, name)), {})
            entry["properties"] = dict(sorted(fields.items()))
            entry["additionalProperties"] = False
    unknown = set(properties) - set(daemon_keys())
    if unknown:
        raise SystemExit(f"values.schema.json describes keys the daemon does not read: {sorted(unknown)}")
    node["properties"] = dict(sorted(properties.items()))
    node["additionalProperties"] = False
    return schema


def render(schema: dict) -> str:
    return json.dumps(schema, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is not what it would be")
    args = parser.parse_args(argv)
    current = SCHEMA.read_text()
    wanted = render(updated(json.loads(current)))
    if args.check:
        if current != wanted:
            print(f"{SCHEMA} is stale: run make chart-schema", file=sys.stderr)
            return 1
        return 0
    SCHEMA.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
