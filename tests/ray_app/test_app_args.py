"""The app builder's arguments as `serve run` passes them: YAML values from a config file, or
strings from `serve run mha_serve.ray_app.build key=value` (no Ray cluster needed)."""

from __future__ import annotations

import pytest

from mha_serve.ray_app import build


def direct_streams(app) -> bool:
    return app._bound_deployment.init_args[-1]  # AttentionReplica's last argument


# Found by a walk through docs/ray.md: `serve run mha_serve.ray_app.build direct_streams=false`
# passes the string "false", which bool() made True: direct streams stayed on.
@pytest.mark.parametrize("value", [False, "false", "False", "0", "no", "off"])
def test_direct_streams_off(value):
    assert direct_streams(build({"direct_streams": value})) is False


@pytest.mark.parametrize("value", [True, "true", "1", "yes"])
def test_direct_streams_on(value):
    assert direct_streams(build({"direct_streams": value})) is True


def test_direct_streams_on_by_default():
    assert direct_streams(build({})) is True


def test_a_value_that_is_no_bool_is_refused():
    with pytest.raises(ValueError, match=r"args.direct_streams must be true or false, got 'flase'"):
        build({"direct_streams": "flase"})
