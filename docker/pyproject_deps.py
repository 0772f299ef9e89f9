"""Print pyproject.toml's [project] dependencies, one per line, minus the names given.

Used by docker/Dockerfile so the image installs exactly the package's runtime requirements
(in a layer that only changes when pyproject.toml does), without copying the list by hand:

    python3 pyproject_deps.py pyproject.toml                      # everything
    python3 pyproject_deps.py pyproject.toml torch torchvision    # minus what the base provides
    python3 pyproject_deps.py pyproject.toml --extras "wandb mlflow"   # those optional extras only
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


def extra_dependencies(text: str, extras: list[str]) -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:
        found = []
        for extra in extras:
            block = re.search(rf"^{re.escape(extra)}\s*=\s*\[(.*?)\]", text, re.S | re.M)
            found += re.findall(r"""["']([^"']+)["']""", block.group(1)) if block else []
        return found
    optional = tomllib.loads(text).get("project", {}).get("optional-dependencies", {})
    return [r for extra in extras for r in optional.get(extra, [])]


def name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def main() -> int:
    path, *excluded = sys.argv[1:]
    if excluded[:1] == ["--extras"]:
        extras = " ".join(excluded[1:]).replace(",", " ").split()
        with open(path, encoding="utf-8") as f:
            text = f.read()
        unknown = [e for e in extras if not extra_dependencies(text, [e])]
        if unknown:
            print(f"error: TRACKERS: unknown extra {', '.join(unknown)} (use wandb, mlflow)", file=sys.stderr)
            return 2
        print("\n".join(extra_dependencies(text, extras)))
        return 0
    skip = {e.lower().replace("_", "-") for e in excluded}
    with open(path, encoding="utf-8") as f:
        for requirement in dependencies(f.read()):
            if name(requirement) not in skip:
                print(requirement)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
