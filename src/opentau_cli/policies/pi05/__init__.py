"""The pi05 reference policy (and pi0) built from transformers modules."""

from opentau_cli.policies.pi05.modeling import Pi05Policy

__all__ = ["Pi05Policy"]
