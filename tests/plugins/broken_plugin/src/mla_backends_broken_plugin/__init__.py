"""Test fixture: a plugin that fails on import. mla-backends must record it and keep selecting."""

raise RuntimeError("mla_backends_broken_plugin: deliberately broken on import (test fixture)")
