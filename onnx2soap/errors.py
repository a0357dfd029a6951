"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class UserError(Exception):
    """Bad input: the message names the file, node or field and what would be accepted."""


class ModelError(UserError):
    """The ONNX file cannot be read or uses something onnx2soap does not support."""


class PlanError(UserError):
    """A plan file or strategy is invalid."""


class MachineError(UserError):
    """A machine file or preset name is invalid."""
