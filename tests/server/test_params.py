"""appliance/server/params.py on its own: the temperature a request samples at."""

from __future__ import annotations

from appliance.server.params import API_TEMPERATURE, ChatParams, temperature
from appliance.spec import ModelSpec

PLAIN = ModelSpec(name="m", source="/models/m")
GREEDY = ModelSpec(name="m", source="/models/m", default_temperature=0)


def test_a_request_s_own_temperature_wins_over_its_model_s_default():
    assert temperature(0.7, GREEDY) == 0.7
    assert temperature(0.0, PLAIN) == 0.0


def test_a_request_that_names_none_gets_its_model_s_default_else_the_api_s():
    assert temperature(None, GREEDY) == 0.0
    assert temperature(None, PLAIN) == API_TEMPERATURE == 1.0
    params = ChatParams.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    assert params.sampling(GREEDY).temperature == 0.0
