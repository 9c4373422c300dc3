"""Names, keys, label values, paths and image references, as Kubernetes validates them.

Each mirrors an upstream check: from k8s.io/apimachinery/pkg/util/validation, object names are DNS-1123
subdomains (IsDNS1123Subdomain), volume and port names DNS-1123 labels (IsDNS1123Label), ConfigMap and
Secret keys IsConfigMapKey, label and annotation keys and resource names qualified names
(IsQualifiedName), label values IsValidLabelValue; sub-paths hold no `..` (ValidatePathNoBacksteps,
k8s.io/kubernetes/pkg/apis/core/validation); images are what distribution/reference parses. The patterns
hold no backslashes: CEL rules embed them in string literals.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field

from grpo_api.spec import cel

#: Names of Kubernetes objects (DNS-1123 subdomains) and of volumes and ports (DNS-1123 labels).
#: No backslashes in these patterns: the CEL rules embed them in string literals.
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = rf"{_DNS_LABEL}([.]{_DNS_LABEL})*"
DNS_SUBDOMAIN_PATTERN = rf"^{DNS_SUBDOMAIN}$"
DNS_LABEL_PATTERN = rf"^{_DNS_LABEL}$"
#: An optional object name: empty (unset) or a DNS-1123 subdomain.
OPTIONAL_NAME_PATTERN = rf"^({DNS_SUBDOMAIN})?$"
#: ConfigMap and Secret keys (IsConfigMapKey: [-._a-zA-Z0-9]+, but not '.', '..' nor starting with '..').
KEY_PATTERN = r"^[.]?[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"
#: Label and annotation keys, resource names (qualified names): [PREFIX/]NAME with PREFIX a DNS-1123
#: subdomain of at most 253 characters (checked apart: a pattern cannot count it) and NAME at most 63
#: characters of [-A-Za-z0-9_.] that start and end alphanumeric. A label value is such a NAME or empty.
QUALIFIED_NAME_PART = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
QUALIFIED_NAME_PATTERN = rf"^({DNS_SUBDOMAIN}/)?{QUALIFIED_NAME_PART}$"
LABEL_VALUE_PATTERN = rf"^({QUALIFIED_NAME_PART})?$"
MAX_QUALIFIED_NAME_PREFIX = 253
QUALIFIED_NAME_TEXT = (
    "NAME or PREFIX/NAME: NAME at most 63 characters of a-z, A-Z, 0-9, '-', '_' and '.' that start and end "
    "with a letter or digit, PREFIX a lowercase DNS subdomain of at most 253 characters"
)


def is_qualified_name(key: str) -> bool:
    """A label key, annotation key or resource name as Kubernetes validates it (IsQualifiedName)."""
    return re.fullmatch(QUALIFIED_NAME_PATTERN, key) is not None and key.find("/") <= MAX_QUALIFIED_NAME_PREFIX


def qualified_name_cel(var: str) -> str:
    """CEL: the string `var` is a qualified name (is_qualified_name)."""
    return f"{var}.matches('{QUALIFIED_NAME_PATTERN}') && {var}.indexOf('/') <= {MAX_QUALIFIED_NAME_PREFIX}"


def ObjectName(description: str) -> Any:
    return Field(description=description, min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)


def OptionalName(description: str) -> Any:
    """An optional reference to an object by name (a claim, a class, a ServiceAccount): unset, "" or a name."""
    return Field(default=None, description=description, max_length=253, pattern=OPTIONAL_NAME_PATTERN)


#: A path without `..` elements (ValidatePathNoBacksteps), as CEL on the string `self` and in Python.
NO_DOTDOT_CEL = "!self.matches('(^|/)[.][.](/|$)')"


def has_dotdot(path: str) -> bool:
    return ".." in path.split("/")


#: Label values, node selector values and toleration values.
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]
LABEL_KEYS_MESSAGE = f"keys must be label keys: {QUALIFIED_NAME_TEXT}"
LABEL_KEYS_RULE = cel.rule(f"self.all(k, {qualified_name_cel('k')})", LABEL_KEYS_MESSAGE)


def check_label_keys(value: dict[str, str], message: str = LABEL_KEYS_MESSAGE) -> dict[str, str]:
    """value, if every key is a label key (ValidateLabels), else a ValueError with message."""
    bad = [k for k in value if not is_qualified_name(k)]
    if bad:
        raise ValueError(f"{bad[0]!r}: {message}")
    return value


#: Container images, as distribution/reference parses them: [HOST[:PORT]/]PATH[:TAG][@DIGEST], PATH of
#: lowercase components (IPv6 hosts left out). No backslashes: the CEL rule embeds it.
_IMAGE_COMPONENT = r"[a-z0-9]+(([._]|__|[-]+)[a-z0-9]+)*"
_IMAGE_HOST_PART = r"([a-zA-Z0-9]|[a-zA-Z0-9][-a-zA-Z0-9]*[a-zA-Z0-9])"
IMAGE_PATTERN = (
    rf"^({_IMAGE_HOST_PART}([.]{_IMAGE_HOST_PART})*(:[0-9]+)?/)?{_IMAGE_COMPONENT}(/{_IMAGE_COMPONENT})*"
    r"(:[A-Za-z0-9_][-A-Za-z0-9_.]{0,127})?(@[A-Za-z][A-Za-z0-9]*([-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$"
)
IMAGE_MESSAGE = "must be an image reference such as registry.example.com:5000/team/image:tag or image@sha256:<hex>"
IMAGE_RULE = cel.rule(f"self.matches('{IMAGE_PATTERN}')", IMAGE_MESSAGE)


def check_image(value: str | None) -> str | None:
    """value, if it is unset or an image reference, else a ValueError."""
    if value is not None and not re.fullmatch(IMAGE_PATTERN, value):
        raise ValueError(f"{value!r} {IMAGE_MESSAGE}")
    return value

