"""The functions the tool-calling tests offer a model, in OpenAI's `tools` shape."""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "description": "The time now."},
}  # no parameters
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_weather_arguments(arguments: dict) -> None:
    """`arguments` follow WEATHER's parameters schema."""
    assert set(arguments) == {"city", "days"}, arguments
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 16
    assert isinstance(arguments["days"], int) and 1 <= arguments["days"] <= 7
