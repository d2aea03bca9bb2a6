"""Fifty varied JSON schemas and a chat prompt for each: nested objects, arrays, enums, required
fields, numbers with bounds, strings with patterns and formats. The structured-outputs test and
`bench_structured.py` share them (and send the same requests to vLLM)."""
from __future__ import annotations

from typing import Any

_S = {"type": "string"}
_NAME = {"type": "string", "minLength": 1, "maxLength": 24}
_TEXT = {"type": "string", "maxLength": 80}
_EMAIL = {"type": "string", "pattern": "^[a-z][a-z0-9.]{0,15}@[a-z]{2,12}\\.(com|org|net)$"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}


def _obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


# (what to ask for, schema)
SCHEMAS: list[tuple[str, dict]] = [
    ("a person with a name and an age", _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a book: title, author and year", _obj({"title": _NAME, "author": _NAME,
                                            "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    ("the weather in Paris", _obj({"city": {"const": "Paris"}, "temperature_c": {"type": "number", "minimum": -50,
                                                                                 "maximum": 60},
                                  "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]}})),
    ("a color as RGB", _obj({"r": {"type": "integer", "minimum": 0, "maximum": 255},
                             "g": {"type": "integer", "minimum": 0, "maximum": 255},
                             "b": {"type": "integer", "minimum": 0, "maximum": 255}})),
    ("a hex color code", _obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("three fruits", _obj({"fruits": {"type": "array", "items": _NAME, "minItems": 3, "maxItems": 3}})),
    ("a todo list of up to five items", _obj({"items": {"type": "array", "maxItems": 5, "items": _obj(
        {"task": _TEXT, "done": _BOOL})}})),
    ("a US phone number", _obj({"phone": {"type": "string", "pattern": "^\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}$"}})),
    ("an email address for Alice", _obj({"email": _EMAIL})),
    ("today's date", _obj({"date": {"type": "string", "format": "date"}})),
    ("a product with a price in dollars", _obj({"name": _NAME, "price": {"type": "number", "minimum": 0,
                                                                       "maximum": 10000},
                                               "currency": {"const": "USD"}})),
    ("a movie rating from 1 to 5 stars", _obj({"movie": _NAME, "stars": {"type": "integer", "minimum": 1,
                                                                         "maximum": 5}})),
    ("a yes or no answer: is the sky blue?", _obj({"answer": {"enum": ["yes", "no"]}})),
    ("an address", _obj({"street": _TEXT, "city": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                         "country": {"enum": ["US", "FR", "DE", "JP"]}})),
    ("a company with two employees", _obj({"company": _NAME, "employees": {"type": "array", "minItems": 2,
                                                                           "maxItems": 2,
                                                                           "items": _obj({"name": _NAME,
                                                                                          "role": _NAME})}})),
    ("a point in 3D", _obj({"x": {"type": "number"}, "y": {"type": "number"}, "z": {"type": "number"}})),
    ("a recipe with ingredients", _obj({"dish": _NAME, "ingredients": {"type": "array", "minItems": 1,
                                                                       "maxItems": 4, "items": _NAME},
                                       "minutes": {"type": "integer", "minimum": 1, "maximum": 600}})),
    ("a username (lowercase letters and digits, 3 to 12 characters)",
     _obj({"username": {"type": "string", "pattern": "^[a-z0-9]{3,12}$"}})),
    ("a semantic version number", _obj({"version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"}})),
    ("a traffic light state", _obj({"light": {"enum": ["red", "yellow", "green"]}, "seconds_left": {
        "type": "integer", "minimum": 0, "maximum": 120}})),
    ("a student's grades", _obj({"student": _NAME, "grades": {"type": "array", "maxItems": 4, "items": {
        "type": "integer", "minimum": 0, "maximum": 100}}})),
    ("a flight", _obj({"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string",
                                                                                   "pattern": "^[A-Z]{3}$"},
                       "passengers": {"type": "integer", "minimum": 1, "maximum": 9}})),
    ("a temperature reading, which may be missing", _obj({"sensor": _NAME, "value": {"anyOf": [
        {"type": "number"}, {"type": "null"}]}})),
    ("a shape: a circle with a radius or a square with a side", _obj({"shape": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0}}),
        _obj({"kind": {"const": "square"}, "side": {"type": "number", "minimum": 0}})]}})),
    ("a user profile with optional bio", _obj({"name": _NAME, "bio": _TEXT, "verified": _BOOL},
                                              required=["name", "verified"])),
    ("a chess move", _obj({"piece": {"enum": ["king", "queen", "rook", "bishop", "knight", "pawn"]},
                           "square": {"type": "string", "pattern": "^[a-h][1-8]$"}})),
    ("a time of day", _obj({"time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"}})),
    ("a percentage", _obj({"label": _NAME, "percent": {"type": "number", "minimum": 0, "maximum": 100}})),
    ("a matrix of 2 by 2 integers", _obj({"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": _INT}}})),
    ("a server config", _obj({"host": _NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                              "tls": _BOOL, "workers": {"type": "integer", "minimum": 1, "maximum": 64}})),
    ("a tweet with hashtags", _obj({"text": _TEXT, "hashtags": {"type": "array", "maxItems": 3, "items": {
        "type": "string", "pattern": "^#[A-Za-z]{1,20}$"}}})),
    ("an HTTP response", _obj({"status": {"enum": [200, 201, 400, 404, 500]}, "body": _TEXT})),
    ("a family tree with a parent and children", _obj({"parent": _NAME, "children": {
        "type": "array", "maxItems": 3, "items": _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0,
                                                                               "maximum": 100}})}})),
    ("a latitude and longitude", _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                       "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("a sentiment label for 'I love it'", _obj({"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                                "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("an invoice with line items", _obj({"invoice_id": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
                                         "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": _obj({
                                             "item": _NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                                             "unit_price": {"type": "number", "minimum": 0}})}})),
    ("a country and its capital", _obj({"country": _NAME, "capital": _NAME})),
    ("the planets closest to the sun", _obj({"planets": {"type": "array", "minItems": 1, "maxItems": 4,
                                                         "items": {"enum": ["Mercury", "Venus", "Earth", "Mars"]}}})),
    ("a boolean flag set", _obj({"debug": _BOOL, "verbose": _BOOL, "dry_run": _BOOL})),
    ("a meeting", _obj({"title": _NAME, "date": {"type": "string", "format": "date"},
                        "attendees": {"type": "array", "maxItems": 4, "items": _EMAIL}})),
    ("a dog", _obj({"name": _NAME, "breed": _NAME, "good_boy": {"const": True}})),
    ("a bank transfer", _obj({"iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,20}$"},
                              "amount": {"type": "number", "minimum": 0.01, "maximum": 100000}})),
    ("a nested settings object", _obj({"display": _obj({"theme": {"enum": ["light", "dark"]},
                                                        "font_size": {"type": "integer", "minimum": 8,
                                                                      "maximum": 32}}),
                                       "audio": _obj({"volume": {"type": "integer", "minimum": 0, "maximum": 10},
                                                      "muted": _BOOL})})),
    ("a list of tags", _obj({"tags": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
        "type": "string", "pattern": "^[a-z]{2,10}$"}}})),
    ("a car", _obj({"make": _NAME, "model": _NAME, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
                    "electric": _BOOL})),
    ("a score board", _obj({"home": _NAME, "away": _NAME, "score": _obj({"home": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 20},
                                                                          "away": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 20}})})),
    ("a summary of a story in one sentence", _obj({"summary": _TEXT, "words": {"type": "integer", "minimum": 1,
                                                                                "maximum": 40}})),
    ("an IPv4 address", _obj({"ip": {"type": "string", "pattern":
                                     "^(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])(\\.(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])){3}$"}})),
    ("a list of numbers and their sum", _obj({"numbers": {"type": "array", "minItems": 2, "maxItems": 5,
                                                          "items": {"type": "integer", "minimum": -100,
                                                                    "maximum": 100}},
                                              "sum": {"type": "integer"}})),
    ("a weekday and whether it is a holiday", _obj({"day": {"enum": ["Mon", "Tue", "Wed", "Thu", "Fri", "Sat",
                                                                     "Sun"]}, "holiday": _BOOL})),
]
assert len(SCHEMAS) == 50


def messages(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Answer in JSON: {what}."}]
