"""The GRPORun API: spec and status models, the CRD, the run-config and the wire protocol.

This package imports none of the project's other packages (import contract).
"""

from grpo_api.models import API_VERSION, GROUP, KIND, PLURAL, VERSION, GRPORun, GRPORunSpec, GRPORunStatus

__all__ = ["API_VERSION", "GROUP", "KIND", "PLURAL", "VERSION", "GRPORun", "GRPORunSpec", "GRPORunStatus"]
