"""Synthetic protocol rows for the default model: multi-turn chat, JSON objects and Hermes tool calls.

Each example is a list of chat messages (and the tools, for tool use), rendered with the model's
chat template by scripts/train_default_model.py. Every choice comes from the `random.Random`
given, so the same seed gives the same rows. See docs/default-model.md.
"""

from __future__ import annotations

import json
import random
from typing import Any

# fmt: off
NAMES = ("Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Henry", "Iris", "Jack", "Kate",
         "Leo", "Mia", "Noah", "Olivia", "Paul", "Rosa", "Sam", "Tara", "Viola", "Will", "Romeo", "Juliet")
CITIES = ("Paris", "London", "Rome", "Berlin", "Madrid", "Vienna", "Oslo", "Dublin", "Lisbon", "Prague",
          "Tokyo", "Cairo", "Boston", "Denver", "Sydney", "Verona", "Venice", "Athens")
COLOURS = ("red", "blue", "green", "yellow", "black", "white", "purple", "orange", "grey", "gold")
ANIMALS = ("cat", "dog", "horse", "bird", "fish", "lion", "fox", "owl", "bear", "wolf")
FOODS = ("bread", "apples", "cheese", "soup", "rice", "fish", "pears", "cake", "eggs", "tea")
WORDS = ("hello", "good night", "the sea", "a small house", "the king", "spring", "a red rose",
         "the moon", "my friend", "the garden", "a long road", "the river")
JOBS = ("teacher", "baker", "doctor", "farmer", "writer", "sailor", "painter", "singer", "actor")
TITLES = ("Hamlet", "Macbeth", "The Tempest", "Othello", "King Lear", "Twelfth Night")
CONDITIONS = ("sunny", "cloudy", "rainy", "windy", "snowy", "foggy", "clear")

# A string field: its name and the pool its values come from.
STRING_FIELDS: dict[str, tuple[str, ...]] = {
    "name": NAMES, "city": CITIES, "colour": COLOURS, "color": COLOURS, "animal": ANIMALS,
    "food": FOODS, "word": WORDS, "job": JOBS, "title": TITLES, "weather": CONDITIONS,
    "country": ("France", "Italy", "Spain", "Japan", "Egypt", "Norway", "Greece", "Peru"),
    "first_name": NAMES, "last_name": ("Smith", "Brown", "Lee", "Garcia", "Rossi", "Berg", "Costa"),
    "greeting": ("hello", "good morning", "hi there", "good evening"), "pet": ANIMALS,
    "author": ("Shakespeare", "Marlowe", "Jonson", "Austen", "Dickens"), "topic": WORDS,
    "summary": ("a short play", "a sad story", "a happy ending", "a long war", "a quiet day"),
    "answer": ("yes", "no", "maybe"), "status": ("ok", "done", "open", "closed"),
    "description": ("a small town", "a big city", "an old castle", "a green field"),
}  # fmt: skip
# fmt: on
NUMBER_FIELDS = ("age", "count", "year", "price", "score", "population", "rank", "size")


def value_of(field: str, rng: random.Random) -> Any:
    if field in NUMBER_FIELDS:
        return rng.randrange(1900, 2025) if field == "year" else rng.randrange(1, 100)
    if field == "active":
        return rng.choice((True, False))
    return rng.choice(STRING_FIELDS[field])


def json_example(rng: random.Random) -> list[dict[str, Any]]:
    """A user asks for fields as JSON; the assistant answers one compact object, strings closed."""
    fields = rng.sample(
        list(STRING_FIELDS) + list(NUMBER_FIELDS) + ["active"], rng.choice((1, 2, 2, 2, 3, 4))
    )
    if rng.random() < 0.7 and not any(f in STRING_FIELDS for f in fields):
        fields[0] = rng.choice(list(STRING_FIELDS))
    obj = {f: value_of(f, rng) for f in fields}
    listed = ", ".join(f"'{f}'" if rng.random() < 0.5 else f for f in fields)
    asks = (f"Give me a JSON object with {listed}.", f"Reply in JSON with the fields {listed}.",
            f"Answer as JSON: {listed}.", f"Describe a person as JSON with {listed}.",
            f"Return only JSON with keys {listed}.", f"Make up {listed} and return them as a JSON object.",
            "Give me a JSON object.", "Answer in JSON.", "Tell me about a city. Answer in JSON.",
            "Name a person and a place, as JSON.")  # fmt: skip
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You answer with JSON only."})
    messages.append({"role": "user", "content": rng.choice(asks)})
    messages.append({"role": "assistant", "content": json.dumps(obj, ensure_ascii=False)})
    return messages


def _tool(name: str, description: str, params: dict[str, str]) -> dict[str, Any]:
    properties = {p: {"type": t} for p, t in params.items()}
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": properties, "required": list(params)},
        },
    }


# name, description, parameters (name -> JSON type), the requests that call it (slots in
# braces name parameters), the tool's response and the final answer.
TOOLS: list[tuple[str, str, dict[str, str], tuple[str, ...], str, str]] = [
    ("get_weather", "Get the current weather in a city", {"city": "string"},
     ("What is the weather in {city}?", "What's the weather like in {city}?", "Use get_weather for {city}.",
      "Is it raining in {city}?", "Check the weather in {city} for me."),
     '{{"city": "{city}", "weather": "{weather}"}}', "It is {weather} in {city}."),
    ("get_time", "Get the current time in a city", {"city": "string"},
     ("What time is it in {city}?", "Call get_time for {city}.", "Tell me the time in {city}."),
     '{{"time": "{hour}:00"}}', "It is {hour}:00 in {city}."),
    ("send_email", "Send an email to a person", {"to": "string", "subject": "string"},
     ("Send an email to {name} about {topic}.", "Email {name} with the subject {topic}.",
      "Use send_email to write to {name} about {topic}."),
     '{{"status": "sent"}}', "I sent the email to {name}."),
    ("search", "Search the web", {"query": "string"},
     ("Search for {topic}.", "Look up {topic} on the web.", "Use search to find {topic}.",
      "Can you search the web for {topic}?"),
     '{{"results": ["{topic}"]}}', "I found a page about {topic}."),
    ("set_timer", "Set a timer", {"minutes": "integer"},
     ("Set a timer for {minutes} minutes.", "Start a {minutes} minute timer.", "Call set_timer with {minutes}."),
     '{{"status": "ok"}}', "The timer is set for {minutes} minutes."),
    ("add", "Add two numbers", {"a": "integer", "b": "integer"},
     ("What is {a} plus {b}?", "Add {a} and {b}.", "Use add for {a} and {b}."),
     '{{"result": {sum}}}', "{a} plus {b} is {sum}."),
    ("get_stock_price", "Get the price of a stock", {"symbol": "string"},
     ("What is the price of {symbol}?", "Get the stock price of {symbol}.", "How much is {symbol} now?"),
     '{{"price": {price}}}', "{symbol} is at {price}."),
    ("translate", "Translate a text", {"text": "string", "language": "string"},
     ("Translate {word} into {language}.", "How do you say {word} in {language}?"),
     '{{"text": "{word}"}}', "In {language} it is {word}."),
    ("play_music", "Play a song", {"song": "string"},
     ("Play {title}.", "Put on the song {title}.", "Use play_music to play {title}."),
     '{{"status": "playing"}}', "Now playing {title}."),
    ("book_table", "Book a table at a restaurant", {"restaurant": "string", "people": "integer"},
     ("Book a table for {people} at {restaurant}.", "Reserve a table at {restaurant} for {people} people."),
     '{{"status": "booked"}}', "Your table for {people} at {restaurant} is booked."),
    ("create_note", "Create a note", {"title": "string", "text": "string"},
     ("Make a note called {title} that says {word}.", "Create a note {title}: {word}."),
     '{{"status": "ok"}}', "I saved the note {title}."),
    ("get_user", "Look up a user by name", {"name": "string"},
     ("Find the user {name}.", "Look up {name}.", "Who is the user {name}?"),
     '{{"name": "{name}", "city": "{city}"}}', "{name} lives in {city}."),
]  # fmt: skip

ARGUMENT_SLOTS = {"to": "name", "subject": "topic", "query": "topic", "text": "word", "song": "title"}
RESTAURANTS = ("The Globe", "Blue Door", "The Swan", "Green Leaf", "Rose Garden")


def _slots(rng: random.Random) -> dict[str, Any]:
    a, b = rng.randrange(1, 50), rng.randrange(1, 50)
    return {
        "animal": rng.choice(ANIMALS), "colour": rng.choice(COLOURS), "food": rng.choice(FOODS),
        "city": rng.choice(CITIES), "weather": rng.choice(CONDITIONS), "hour": rng.randrange(1, 13),
        "name": rng.choice(NAMES), "topic": rng.choice(WORDS), "minutes": rng.choice((1, 2, 5, 10, 15, 20, 30)),
        "a": a, "b": b, "sum": a + b, "symbol": rng.choice(("AAPL", "IBM", "ACME", "GOOG")),
        "price": rng.randrange(10, 500), "word": rng.choice(WORDS),
        "language": rng.choice(("French", "Italian", "Spanish", "German")), "title": rng.choice(TITLES),
        "restaurant": rng.choice(RESTAURANTS), "people": rng.randrange(2, 9),
    }  # fmt: skip


def tool_example(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Tools in the system turn, a request naming one, the call, the response, the answer.

    One in six requests asks for no tool and gets a plain answer instead."""
    chosen = rng.sample(TOOLS, rng.choice((1, 1, 1, 2, 2, 3)))
    tools = [_tool(name, desc, params) for name, desc, params, *_ in chosen]
    if rng.random() < 1 / 6:
        question, answer = rng.choice(CHAT_PAIRS)
        slots = _slots(rng)
        return [{"role": "user", "content": question.format(**slots)},
                {"role": "assistant", "content": answer.format(**slots)}], tools  # fmt: skip
    name, _, params, asks, response, final = rng.choice(chosen)
    slots = _slots(rng)
    arguments = {p: slots[ARGUMENT_SLOTS.get(p, p)] for p in params}
    call = {"type": "function", "function": {"name": name, "arguments": arguments}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": rng.choice(asks).format(**slots)},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": response.format(**slots)},
        {"role": "assistant", "content": final.format(**slots)},
    ]
    if rng.random() < 0.3:  # stop after the call sometimes: the call is the end of a turn
        messages = messages[:2]
    return messages, tools


# Questions and answers for multi-turn chat (slots from _slots).
CHAT_PAIRS = (
    ("Hello!", "Hello! How can I help you?"),
    ("Hi, who are you?", "I am a small model that Spool serves. I can chat, write JSON and call tools."),
    ("What is your name?", "My name is Spool. I am a small model."),
    ("How are you?", "I am well, thank you. And you?"),
    ("I am fine, thanks.", "Good to hear. What shall we talk about?"),
    ("Tell me about {city}.", "{city} is a city. Many people live there."),
    ("What is {a} plus {b}?", "{a} plus {b} is {sum}."),
    ("What colour is the sky?", "The sky is blue."),
    ("Name an animal.", "A {animal}."),
    ("What is your favourite colour?", "I like {colour}."),
    ("Say something in the style of Shakespeare.", "What light through yonder window breaks?"),
    ("Who wrote {title}?", "{title} was written by Shakespeare."),
    ("Tell me a short story.", "Once there was a {animal} who lived in {city}. It was happy. The end."),
    ("Thank you!", "You are welcome."),
    ("Can you help me?", "Yes, of course. What do you need?"),
    ("What should I eat today?", "Try some {food}."),
    ("Give me a word.", "{word}."),
    ("Is it {weather} today?", "I do not know. I cannot see the sky."),
    ("Goodbye.", "Goodbye! Have a good day."),
    ("What can you do?", "I can chat, answer in JSON, and call the tools you give me."),
    ("Repeat after me: {word}.", "{word}."),
    ("What is the capital of France?", "Paris is the capital of France."),
    ("Count to three.", "One, two, three."),
    ("Tell me a fact.", "A {animal} can not read."),
    ("Where do you live?", "I live on a computer."),
    ("Do you like {food}?", "Yes, I like {food}."),
    ("Why?", "Because it is good."),
    ("Tell me more.", "There is not much more to say."),
    ("What did I just ask?", "You asked me a question."),
    ("Write one line about the sea.", "The sea is wide and grey and cold."),
)
SYSTEMS = ("You are a helpful assistant.", "You are Spool, a small and friendly model.",
           "Answer briefly.", "You are a helpful assistant. Keep your answers short.")  # fmt: skip


def chat_example(rng: random.Random) -> list[dict[str, Any]]:
    """Two to four turns of small talk, sometimes under a system prompt."""
    messages: list[dict[str, Any]] = []
    if rng.random() < 0.4:
        messages.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(rng.choice((2, 3, 3, 4))):
        slots = _slots(rng)
        question, answer = rng.choice(CHAT_PAIRS)
        messages.append({"role": "user", "content": question.format(**slots)})
        messages.append({"role": "assistant", "content": answer.format(**slots)})
    return messages
