"""`kvray`'s own names: every one resolves, each is the object of the kvray module that defines it,
and the Ray actors load on first use, so `import kvray` works without Ray."""

from __future__ import annotations

import subprocess
import sys

import kvray


def test_every_public_name_is_the_object_its_module_defines() -> None:
    for name in kvray.__all__:
        value = getattr(kvray, name)
        module = sys.modules[value.__module__]
        assert module.__name__.startswith("kvray.") and getattr(module, name) is value, name


def test_the_actors_load_on_first_use() -> None:
    script = (
        "import sys\n"
        "import kvray\n"
        "assert 'kvray.workers' not in sys.modules, 'import kvray imported the workers'\n"
        "actor = kvray.PrefillActor\n"
        "import kvray.workers\n"
        "assert actor is kvray.workers.PrefillActor and kvray.DecodeActor is kvray.workers.DecodeActor\n"
        "try:\n"
        "    kvray.NoSuchName\n"
        "except AttributeError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('an unknown name resolved')\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
