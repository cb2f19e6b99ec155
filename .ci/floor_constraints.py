"""The floor versions: setup.cfg's `>=` lower bounds as pip constraints (`name==bound`), so `make test-floor` tests
exactly what setup.cfg claims, with the bounds written once.

    python .ci/floor_constraints.py [setup.cfg]            print the constraints (one `name==version` a line)
    python .ci/floor_constraints.py --verify [setup.cfg]   exit 1 unless the running Python has exactly those
    python .ci/floor_constraints.py --verify-newest torch [setup.cfg]
                                                           exit 1 unless the running Python has the newest minor
                                                           release setup.cfg allows of torch (`<2.16`: a 2.15)

Standard library only: it runs before any virtual environment exists.
"""

import configparser
import itertools
import re
import sys
from importlib import metadata

REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$")
FLOOR_EXTRAS = ("gpu",)  # extras whose requirements have floors too (the test and viz tools do not count)


def requirements(setup_cfg: str) -> dict[str, str]:
    """{requirement line without comments: its `name` match} for every install requirement and every requirement of
    the extras in FLOOR_EXTRAS."""
    parser = configparser.ConfigParser()
    if not parser.read(setup_cfg):
        sys.exit(f"floor_constraints: cannot read {setup_cfg}")
    lines = parser.get("options", "install_requires").splitlines()
    for extra in FLOOR_EXTRAS:
        lines += parser.get("options.extras_require", extra).splitlines()
    stripped = (line.split("#", 1)[0].strip() for line in lines)
    return {line: REQUIREMENT.match(line) for line in stripped if line}


def bounds(specifiers: str, operator: str) -> list[str]:
    """The versions of `specifiers` (`>=2.10,<2.16`) that follow `operator` (`>=` or `<`)."""
    return [s.strip()[len(operator):].strip() for s in specifiers.split(",")
            if s.strip().startswith(operator) and not s.strip().startswith(operator + "=")]


def floors(setup_cfg: str) -> dict[str, str]:
    """{distribution name: its lower bound} for every requirement `requirements` lists; each must have a `>=`
    bound."""
    result = {}
    for line, match in requirements(setup_cfg).items():
        lower = bounds(match.group(2), ">=") if match else []
        if len(lower) != 1:
            sys.exit(f"floor_constraints: {setup_cfg}: install requirement {line!r} needs exactly one '>=' lower "
                     "bound (the oldest version CI tests).")
        result[match.group(1)] = lower[0]
    return result


def same_version(installed: str, floor: str) -> bool:
    """2.13.0+cpu is the floor 2.13; 1.5.0 is 1.5.0 (trailing zeros and local labels do not count)."""
    numbers = ([int(p) for p in version.split("+", 1)[0].split(".")] for version in (installed, floor))
    return all(a == b for a, b in itertools.zip_longest(*numbers, fillvalue=0))


def verify_newest(setup_cfg: str, name: str) -> int:
    """Exit status 1 unless the installed `name` is of the minor release just below its `<X.Y` bound in setup.cfg
    (a pip configuration's own constraints can cap a package below the range setup.cfg claims)."""
    found = [match for match in requirements(setup_cfg).values() if match and match.group(1) == name]
    if not found:
        sys.exit(f"floor_constraints: {setup_cfg} does not require {name}")
    upper = bounds(found[0].group(2), "<")
    if len(upper) != 1:
        sys.exit(f"floor_constraints: {name} needs exactly one '<' upper bound in {setup_cfg}")
    major, minor = (int(p) for p in upper[0].split(".")[:2])
    installed, newest = metadata.version(name), f"{major}.{minor - 1}"
    ok = installed.split("+", 1)[0].split(".")[:2] == newest.split(".")
    print(f"  {name:<16} newest claimed {newest}.x  installed {installed}{'' if ok else '   <-- not the newest'}")
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    if "--verify-newest" in argv:
        at = argv.index("--verify-newest")
        if at + 1 >= len(argv):
            sys.exit("floor_constraints: --verify-newest needs a distribution name, e.g. --verify-newest torch")
        rest = argv[:at] + argv[at + 2:]
        return verify_newest(rest[0] if rest else "setup.cfg", argv[at + 1])
    args = [a for a in argv if a != "--verify"]
    wanted = floors(args[0] if args else "setup.cfg")
    if "--verify" not in argv:
        print("\n".join(f"{name}=={version}" for name, version in wanted.items()))
        return 0
    wrong = []
    for name, version in wanted.items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed = "not installed"
        ok = installed != "not installed" and same_version(installed, version)
        print(f"  {name:<16} floor {version:<9} installed {installed}{'' if ok else '   <-- not the floor'}")
        if not ok:
            wrong.append(name)
    if wrong:
        print(f"floor_constraints: {', '.join(wrong)} not at setup.cfg's lower bound", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
