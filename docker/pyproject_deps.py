"""Print pyproject.toml's [project] dependencies, one per line, minus the names given.

Used by docker/Dockerfile so the image installs exactly the package's runtime requirements
(in a layer that only changes when pyproject.toml does), without copying the list by hand:

    python3 pyproject_deps.py pyproject.toml                      # everything
    python3 pyproject_deps.py pyproject.toml torch torchvision    # minus what the base provides
"""

import re
import sys


def dependencies(text: str) -> list[str]:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # Python 3.10: the flat list of strings is easy to read by hand
        block = re.search(r"^dependencies\s*=\s*\[(.*?)\]", text, re.S | re.M)
        return re.findall(r"""["']([^"']+)["']""", block.group(1)) if block else []
    return list(tomllib.loads(text).get("project", {}).get("dependencies", []))


def name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def main() -> int:
    path, *excluded = sys.argv[1:]
    skip = {e.lower().replace("_", "-") for e in excluded}
    with open(path, encoding="utf-8") as f:
        for requirement in dependencies(f.read()):
            if name(requirement) not in skip:
                print(requirement)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
