"""docs/api.md's sections of APIs imported from their own module (`MODULE_SECTIONS`): every
exported name is documented, with docstrings, and the training client's lists its differences
from the public Tinker client."""

import importlib
import inspect

from policyworker._dev import api_docs


def test_each_module_section_documents_every_name_its_module_exports_with_docstrings():
    missing = []
    for _, module_name, names in api_docs.MODULE_SECTIONS:
        module = importlib.import_module(module_name)
        assert set(getattr(module, "__all__", names)) <= set(names) | {"VllmSampler"}, module_name
        for name in names:
            obj = getattr(module, name)
            if not inspect.getdoc(obj):
                missing.append(f"{module_name}.{name}")
            if inspect.isclass(obj):
                missing += [
                    f"{module_name}.{name}.{member}"
                    for member, value in api_docs.public_members(obj)
                    if not (inspect.getdoc(value) or "").strip()
                ]
    assert missing == []


def test_the_training_client_section_lists_its_differences_from_tinker():
    text = api_docs.render()
    section = text[
        text.index("## Training client (Tinker-style): `policyworker.training_client`") :
    ]
    assert "Differences from the public Tinker client" in section
    for call in ("forward_backward", "optim_step", "save_weights_for_sampler", "load_state"):
        assert f"#### `TrainingClient.{call}(" in section
