"""Security defaults the built image keeps: an unprivileged user, and nothing of the checkout but the package."""

from __future__ import annotations

from containerlib import CPU_IMAGE


def run_in_image(docker_client, *command: str, user: str = "") -> str:
    output = docker_client.containers.run(CPU_IMAGE, entrypoint=list(command), network_mode="host", remove=True,
                                          user=user)
    return output.decode().strip()


def test_image_runs_as_a_non_root_user(docker_client, cpu_image):
    configured = docker_client.images.get(CPU_IMAGE).attrs["Config"]["User"]
    assert configured not in ("", "0", "root"), f"image user is {configured!r}"
    assert int(run_in_image(docker_client, "id", "-u")) != 0


def test_image_holds_no_dotenv_git_or_tests(docker_client, cpu_image):
    # .dockerignore is an allow-list: a .env (secrets), .git, tests or data never reach a layer.
    found = run_in_image(docker_client, "sh", "-c",
                         "find / -xdev \\( -name .env -o -name .git -o -name .ci -o -path '*/tests/containers' \\) "
                         "-print", user="0")  # root: every directory is searched
    assert found == "", found
