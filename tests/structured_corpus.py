"""The structured-output corpus: JSON schemas as clients send them, each with a chat prompt and a valid instance.

Nested objects, arrays with bounds, enums, const, anyOf/oneOf, $ref/$defs, string patterns and formats, numeric
ranges, optional fields, nulls, string length bounds, and the shapes the openai SDK's `parse()` makes from
Pydantic models. tests/test_structured_output_corpus.py checks every example against its schema and the
engine's grammar; benchmarks/structured_output.py asks the embedded model for each schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jsonschema

FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@dataclass(frozen=True)
class Case:
    """One schema of the corpus: a short name, the schema, a chat prompt asking for it, a valid instance."""

    name: str
    schema: dict[str, Any]
    prompt: str
    example: Any


def closed(properties: dict[str, Any], optional: Sequence[str] = ()) -> dict[str, Any]:
    """An object schema with these properties, all required but `optional`, and no others."""
    return {
        "type": "object",
        "properties": properties,
        "required": [name for name in properties if name not in optional],
        "additionalProperties": False,
    }


def text(max_length: int, min_length: int = 1) -> dict[str, Any]:
    return {"type": "string", "minLength": min_length, "maxLength": max_length}


def integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def number(minimum: float, maximum: float) -> dict[str, Any]:
    return {"type": "number", "minimum": minimum, "maximum": maximum}


def enum(*values: Any) -> dict[str, Any]:
    return {"enum": list(values)}


def array(items: dict[str, Any], min_items: int, max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


DATE = {"type": "string", "format": "date"}
EMAIL = {"type": "string", "format": "email"}
UUID = {"type": "string", "format": "uuid"}
BOOLEAN = {"type": "boolean"}
POSITIVE = {"type": "number", "exclusiveMinimum": 0}
ADDRESS = closed(
    {
        "street": text(60),
        "city": text(40),
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": enum("US", "FR", "DE", "JP", "BR"),
    }
)
ADDRESS_EXAMPLE = {"street": "12 Rue de Rivoli", "city": "Paris", "postal_code": "75004", "country": "FR"}
TREE_NODE = closed({"label": text(20), "children": array({"$ref": "#/$defs/node"}, 0, 2)})

# What the openai SDK's `parse()` sends for Pydantic models (openai.lib._pydantic.to_strict_json_schema):
# titles, every property required, Optional as anyOf with null, nested models and enums under $defs.
OPENAI_ADDRESS = {
    "properties": {
        "street": {"title": "Street", "type": "string"},
        "city": {"title": "City", "type": "string"},
        "zip": {"anyOf": [{"type": "string"}, {"type": "null"}], "title": "Zip"},
    },
    "required": ["street", "city", "zip"],
    "title": "Address",
    "type": "object",
    "additionalProperties": False,
}
OPENAI_COLOR = {"enum": ["red", "green", "blue"], "title": "Color", "type": "string"}
OPENAI_STEP = {
    "properties": {
        "explanation": {"title": "Explanation", "type": "string"},
        "output": {"title": "Output", "type": "string"},
    },
    "required": ["explanation", "output"],
    "title": "Step",
    "type": "object",
    "additionalProperties": False,
}
OPENAI_LINE_ITEM = {
    "properties": {
        "product": {"title": "Product", "type": "string"},
        "quantity": {"title": "Quantity", "type": "integer", "minimum": 1},
        "unit_price": {"title": "Unit Price", "type": "number"},
    },
    "required": ["product", "quantity", "unit_price"],
    "title": "LineItem",
    "type": "object",
    "additionalProperties": False,
}
OPENAI_ORDER_STATUS = {"enum": ["pending", "shipped", "delivered"], "title": "OrderStatus", "type": "string"}


def openai_model(title: str, properties: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A Pydantic model's schema as the openai SDK makes it strict."""
    schema: dict[str, Any] = {"$defs": defs} if defs else {}
    return {
        **schema,
        "properties": properties,
        "required": list(properties),
        "title": title,
        "type": "object",
        "additionalProperties": False,
    }


CORPUS: list[Case] = [
    Case(
        "person",
        closed({"name": text(40), "age": integer(0, 120), "email": EMAIL}),
        "Give a JSON object describing a person: their name, age and email address.",
        {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    ),
    Case(
        "book",
        closed(
            {
                "title": text(80),
                "author": text(40),
                "year": integer(1450, 2030),
                "isbn": {"type": "string", "pattern": "^97[89]-[0-9]{10}$"},
                "genres": array(enum("fiction", "history", "science", "poetry", "fantasy"), 1, 3),
            }
        ),
        "Give a JSON object describing a well-known book: title, author, year, ISBN-13 and genres.",
        {"title": "Dune", "author": "Frank Herbert", "year": 1965, "isbn": "978-0441172719", "genres": ["fiction"]},
    ),
    Case(
        "address",
        ADDRESS,
        "Give a JSON object describing a postal address in Paris.",
        ADDRESS_EXAMPLE,
    ),
    Case(
        "product",
        closed(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "name": text(50),
                "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
                "in_stock": BOOLEAN,
                "tags": array(text(15), 0, 4),
            }
        ),
        "Give a JSON object describing a product in an online shop: SKU, name, price, stock and tags.",
        {"sku": "KBD-0042", "name": "Mechanical keyboard", "price": 89.9, "in_stock": True, "tags": ["usb"]},
    ),
    Case(
        "weather",
        closed(
            {
                "city": text(40),
                "date": DATE,
                "temperature_c": number(-60, 60),
                "condition": enum("sunny", "cloudy", "rain", "snow", "fog"),
                "humidity": integer(0, 100),
            }
        ),
        "Give a JSON object describing today's weather in London.",
        {"city": "London", "date": "2024-05-17", "temperature_c": 14.5, "condition": "rain", "humidity": 81},
    ),
    Case(
        "event",
        closed(
            {
                "title": text(60),
                "date": DATE,
                "start_time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
                "location": text(60),
                "attendees": array(EMAIL, 1, 3),
            }
        ),
        "Give a JSON object describing a team meeting: title, date, start time, place and attendees' emails.",
        {
            "title": "Sprint review",
            "date": "2024-09-03",
            "start_time": "14:30",
            "location": "Room 4",
            "attendees": ["bob@example.com"],
        },
    ),
    Case(
        "record_uuid",
        closed({"id": UUID, "created": DATE, "active": BOOLEAN}),
        "Give a JSON object describing a database record with a UUID, its creation date and whether it is active.",
        {"id": "123e4567-e89b-12d3-a456-426614174000", "created": "2023-01-31", "active": False},
    ),
    Case(
        "color",
        closed(
            {
                "name": text(30),
                "rgb": array(integer(0, 255), 3, 3),
                "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"},
            }
        ),
        "Give a JSON object describing the color orange: its name, RGB values and hex code.",
        {"name": "orange", "rgb": [255, 165, 0], "hex": "#ffa500"},
    ),
    Case(
        "point_3d",
        closed({"x": {"type": "number"}, "y": {"type": "number"}, "z": {"type": "number"}}),
        "Give a JSON object describing a point in 3D space.",
        {"x": 1.5, "y": -2, "z": 0.25},
    ),
    Case(
        "polygon",
        closed({"name": text(30), "vertices": array(closed({"x": integer(-100, 100), "y": integer(-100, 100)}), 3, 6)}),
        "Give a JSON object describing a triangle with its vertices.",
        {"name": "triangle", "vertices": [{"x": 0, "y": 0}, {"x": 4, "y": 0}, {"x": 0, "y": 3}]},
    ),
    Case(
        "recipe",
        closed(
            {
                "name": text(50),
                "servings": integer(1, 12),
                "ingredients": array(
                    closed({"item": text(30), "quantity": POSITIVE, "unit": enum("g", "ml", "piece", "tbsp", "cup")}),
                    2,
                    5,
                ),
                "steps": array(text(100), 1, 4),
            }
        ),
        "Give a JSON object describing a simple pancake recipe.",
        {
            "name": "Pancakes",
            "servings": 4,
            "ingredients": [
                {"item": "flour", "quantity": 200, "unit": "g"},
                {"item": "milk", "quantity": 300, "unit": "ml"},
            ],
            "steps": ["Mix everything.", "Fry in a pan."],
        },
    ),
    Case(
        "movie",
        closed(
            {
                "title": text(80),
                "year": integer(1888, 2030),
                "director": text(40),
                "rating": number(0, 10),
                "genres": array(enum("drama", "comedy", "action", "sci-fi", "horror", "animation"), 1, 3),
            }
        ),
        "Give a JSON object describing a famous science-fiction movie.",
        {"title": "Alien", "year": 1979, "director": "Ridley Scott", "rating": 8.5, "genres": ["sci-fi", "horror"]},
    ),
    Case(
        "api_success",
        closed(
            {
                "status": {"const": "ok"},
                "code": enum(200, 201, 204),
                "data": closed({"id": integer(1, 1000000), "message": text(80)}),
            }
        ),
        "Give a JSON object describing a successful API response that created a user.",
        {"status": "ok", "code": 201, "data": {"id": 17, "message": "user created"}},
    ),
    Case(
        "api_error",
        closed(
            {
                "status": {"const": "error"},
                "error": closed({"code": {"type": "string", "pattern": "^E[0-9]{3}$"}, "message": text(80)}),
            }
        ),
        "Give a JSON object describing an API error response for a missing resource.",
        {"status": "error", "error": {"code": "E404", "message": "not found"}},
    ),
    Case(
        "shape_oneof",
        {
            "oneOf": [
                closed({"kind": {"const": "circle"}, "radius": POSITIVE}),
                closed({"kind": {"const": "rectangle"}, "width": POSITIVE, "height": POSITIVE}),
            ]
        },
        "Give a JSON object describing a geometric shape, either a circle or a rectangle.",
        {"kind": "circle", "radius": 2.5},
    ),
    Case(
        "payment_anyof",
        closed(
            {
                "amount": POSITIVE,
                "method": {
                    "anyOf": [
                        closed(
                            {
                                "card_number": {"type": "string", "pattern": "^[0-9]{16}$"},
                                "expiry": {"type": "string", "pattern": "^(0[1-9]|1[0-2])/[0-9]{2}$"},
                            }
                        ),
                        closed({"iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{10,20}$"}}),
                    ]
                },
            }
        ),
        "Give a JSON object describing a payment of 25 euros, by card or bank transfer.",
        {"amount": 25, "method": {"iban": "DE89370400440532013000"}},
    ),
    Case(
        "contact_nullable",
        closed(
            {
                "name": text(40),
                "phone": {"type": ["string", "null"], "pattern": "^\\+[0-9]{8,14}$"},
                "email": {"anyOf": [EMAIL, {"type": "null"}]},
            }
        ),
        "Give a JSON object describing a contact with a name, and a phone number and email if known.",
        {"name": "Grace Hopper", "phone": None, "email": "grace@example.com"},
    ),
    Case(
        "tree_recursive",
        {"$defs": {"node": TREE_NODE}, "$ref": "#/$defs/node"},
        "Give a JSON object describing a small tree of animal categories, each node with a label and children.",
        {"label": "animals", "children": [{"label": "birds", "children": []}, {"label": "fish", "children": []}]},
    ),
    Case(
        "org_chart_ref",
        {
            "$defs": {"employee": closed({"name": text(40), "title": text(40), "email": EMAIL})},
            **closed(
                {
                    "company": text(40),
                    "ceo": {"$ref": "#/$defs/employee"},
                    "reports": array({"$ref": "#/$defs/employee"}, 1, 3),
                }
            ),
        },
        "Give a JSON object describing a small company's org chart: the CEO and their direct reports.",
        {
            "company": "Acme",
            "ceo": {"name": "Jane Doe", "title": "CEO", "email": "jane@acme.com"},
            "reports": [{"name": "John Roe", "title": "CTO", "email": "john@acme.com"}],
        },
    ),
    Case(
        "invoice",
        {
            "$defs": {"party": closed({"name": text(40), "address": ADDRESS})},
            **closed(
                {
                    "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
                    "date": DATE,
                    "customer": {"$ref": "#/$defs/party"},
                    "lines": array(
                        closed({"description": text(50), "quantity": integer(1, 100), "unit_price": number(0, 10000)}),
                        1,
                        4,
                    ),
                    "total": number(0, 1000000),
                    "paid": BOOLEAN,
                }
            ),
        },
        "Give a JSON object describing an invoice for two hours of consulting.",
        {
            "invoice_number": "INV-000123",
            "date": "2024-02-29",
            "customer": {"name": "Acme", "address": ADDRESS_EXAMPLE},
            "lines": [{"description": "Consulting", "quantity": 2, "unit_price": 150}],
            "total": 300,
            "paid": False,
        },
    ),
    Case(
        "server_config",
        closed(
            {
                "host": {"type": "string", "format": "ipv4"},
                "port": integer(1, 65535),
                "tls": BOOLEAN,
                "log_level": enum("debug", "info", "warning", "error"),
                "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 300},
            }
        ),
        "Give a JSON object describing a web server's configuration.",
        {"host": "10.0.0.1", "port": 8443, "tls": True, "log_level": "info", "timeout_s": 30},
    ),
    Case(
        "feature_flags",
        closed({"dark_mode": BOOLEAN, "beta_features": BOOLEAN, "analytics": BOOLEAN, "new_checkout": BOOLEAN}),
        "Give a JSON object describing which feature flags are enabled in a mobile app.",
        {"dark_mode": True, "beta_features": False, "analytics": True, "new_checkout": False},
    ),
    Case(
        "user_optional",
        closed(
            {
                "username": {"type": "string", "pattern": "^[a-z0-9_]{3,16}$"},
                "bio": text(160, 0),
                "age": integer(13, 120),
                "website": text(60),
            },
            optional=("bio", "age", "website"),
        ),
        "Give a JSON object describing a social network user profile.",
        {"username": "ada_l", "age": 36},
    ),
    Case(
        "geo_location",
        closed(
            {"latitude": number(-90, 90), "longitude": number(-180, 180), "altitude_m": number(-500, 9000)},
            optional=("altitude_m",),
        ),
        "Give a JSON object describing the location of the Eiffel Tower.",
        {"latitude": 48.8584, "longitude": 2.2945},
    ),
    Case(
        "sentiment",
        closed({"text": text(200), "label": enum("positive", "negative", "neutral"), "confidence": number(0, 1)}),
        "Give a JSON object describing the sentiment of the review 'The food was great but the service was slow.'",
        {"text": "The food was great", "label": "positive", "confidence": 0.8},
    ),
    Case(
        "classification",
        closed(
            {
                "label": enum("spam", "ham", "phishing", "newsletter", "personal"),
                "scores": closed(
                    {
                        "spam": number(0, 1),
                        "ham": number(0, 1),
                        "phishing": number(0, 1),
                    }
                ),
            }
        ),
        "Give a JSON object describing how an email offering a free cruise should be classified.",
        {"label": "spam", "scores": {"spam": 0.9, "ham": 0.05, "phishing": 0.05}},
    ),
    Case(
        "translation",
        closed(
            {
                "source_lang": enum("en", "fr", "de", "es"),
                "target_lang": enum("en", "fr", "de", "es"),
                "text": text(100),
                "translation": text(100),
            }
        ),
        "Give a JSON object describing the French translation of 'Good morning, how are you?'.",
        {"source_lang": "en", "target_lang": "fr", "text": "Good morning", "translation": "Bonjour"},
    ),
    Case(
        "todo_list",
        closed(
            {
                "title": text(40),
                "items": array(
                    closed({"task": text(60), "done": BOOLEAN, "priority": enum("low", "medium", "high")}), 1, 5
                ),
            }
        ),
        "Give a JSON object describing a to-do list for moving house.",
        {"title": "Moving", "items": [{"task": "Pack books", "done": False, "priority": "high"}]},
    ),
    Case(
        "work_week",
        closed(
            {
                "employee": text(40),
                "days": array(enum("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"), 1, 7),
                "hours_per_day": number(1, 12),
            }
        ),
        "Give a JSON object describing which days of the week a part-time employee works.",
        {"employee": "Sam", "days": ["Monday", "Thursday"], "hours_per_day": 6},
    ),
    Case(
        "matrix_2x2",
        closed({"name": text(20), "rows": array(array({"type": "integer"}, 2, 2), 2, 2)}),
        "Give a JSON object describing the 2x2 identity matrix.",
        {"name": "identity", "rows": [[1, 0], [0, 1]]},
    ),
    Case(
        "tuple_prefix_items",
        closed(
            {
                "measurement": {
                    "type": "array",
                    "prefixItems": [text(20), {"type": "number"}, enum("cm", "m", "km")],
                    "items": False,
                    "minItems": 3,
                }
            }
        ),
        "Give a JSON object describing a measurement as a [label, value, unit] triple, for a table's width.",
        {"measurement": ["table width", 120, "cm"]},
    ),
    Case(
        "flight",
        closed(
            {
                "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3,4}$"},
                "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                "departure": DATE,
                "seats_left": integer(0, 500),
                "cabin": enum("economy", "premium", "business", "first"),
            }
        ),
        "Give a JSON object describing a flight from Paris to New York.",
        {
            "flight_number": "AF006",
            "origin": "CDG",
            "destination": "JFK",
            "departure": "2024-07-01",
            "seats_left": 12,
            "cabin": "economy",
        },
    ),
    Case(
        "hotel_booking",
        closed(
            {
                "guest": text(40),
                "check_in": DATE,
                "check_out": DATE,
                "nights": integer(1, 30),
                "room": enum("single", "double", "suite"),
                "breakfast": BOOLEAN,
            }
        ),
        "Give a JSON object describing a three-night hotel booking.",
        {
            "guest": "Alan Turing",
            "check_in": "2024-06-10",
            "check_out": "2024-06-13",
            "nights": 3,
            "room": "double",
            "breakfast": True,
        },
    ),
    Case(
        "bank_transaction",
        closed(
            {
                "id": UUID,
                "amount": number(-100000, 100000),
                "currency": enum("USD", "EUR", "GBP", "JPY"),
                "type": enum("debit", "credit"),
                "date": DATE,
            }
        ),
        "Give a JSON object describing a bank card payment at a supermarket.",
        {
            "id": "9b2f6c1e-4d7a-4f3b-8e2a-1c5d6e7f8a9b",
            "amount": -42.1,
            "currency": "EUR",
            "type": "debit",
            "date": "2024-03-05",
        },
    ),
    Case(
        "student_grades",
        closed(
            {
                "student": text(40),
                "grades": array(
                    closed({"course": text(30), "score": integer(0, 100), "letter": enum("A", "B", "C", "D", "F")}),
                    1,
                    4,
                ),
                "gpa": number(0, 4),
            }
        ),
        "Give a JSON object describing a student's grades this term.",
        {"student": "Mia", "grades": [{"course": "Math", "score": 91, "letter": "A"}], "gpa": 3.8},
    ),
    Case(
        "pet",
        closed(
            {
                "name": text(30),
                "species": enum("dog", "cat", "rabbit", "parrot", "fish"),
                "age": integer(0, 40),
                "vaccinated": BOOLEAN,
                "owner_email": EMAIL,
            }
        ),
        "Give a JSON object describing a family's pet dog.",
        {"name": "Rex", "species": "dog", "age": 4, "vaccinated": True, "owner_email": "owner@example.org"},
    ),
    Case(
        "car",
        closed(
            {
                "make": text(30),
                "model": text(30),
                "year": integer(1950, 2026),
                "electric": BOOLEAN,
                "mileage_km": {"type": "integer", "minimum": 0},
                "color": enum("black", "white", "silver", "red", "blue"),
            }
        ),
        "Give a JSON object describing a used car for sale.",
        {"make": "Toyota", "model": "Corolla", "year": 2015, "electric": False, "mileage_km": 98000, "color": "red"},
    ),
    Case(
        "planet",
        closed(
            {
                "name": text(20),
                "type": enum("terrestrial", "gas giant", "ice giant", "dwarf"),
                "moons": integer(0, 200),
                "has_rings": BOOLEAN,
                "diameter_km": POSITIVE,
            }
        ),
        "Give a JSON object describing the planet Saturn.",
        {"name": "Saturn", "type": "gas giant", "moons": 146, "has_rings": True, "diameter_km": 116460},
    ),
    Case(
        "country",
        closed(
            {
                "name": text(40),
                "iso_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
                "capital": text(40),
                "population": {"type": "integer", "minimum": 0},
                "continent": enum("Africa", "Asia", "Europe", "North America", "South America", "Oceania"),
                "languages": array(text(20), 1, 3),
            }
        ),
        "Give a JSON object describing Japan.",
        {
            "name": "Japan",
            "iso_code": "JP",
            "capital": "Tokyo",
            "population": 125000000,
            "continent": "Asia",
            "languages": ["Japanese"],
        },
    ),
    Case(
        "company",
        {
            "$defs": {"address": ADDRESS},
            **closed(
                {
                    "name": text(40),
                    "founded": integer(1800, 2025),
                    "public": BOOLEAN,
                    "ticker": {"anyOf": [{"type": "string", "pattern": "^[A-Z]{1,5}$"}, {"type": "null"}]},
                    "headquarters": {"$ref": "#/$defs/address"},
                }
            ),
        },
        "Give a JSON object describing a large technology company.",
        {"name": "Initech", "founded": 1990, "public": False, "ticker": None, "headquarters": ADDRESS_EXAMPLE},
    ),
    Case(
        "song",
        closed(
            {
                "title": text(60),
                "artist": text(40),
                "album": {"type": ["string", "null"], "maxLength": 60},
                "duration_s": integer(30, 900),
                "explicit": BOOLEAN,
            }
        ),
        "Give a JSON object describing a popular song.",
        {"title": "Imagine", "artist": "John Lennon", "album": "Imagine", "duration_s": 183, "explicit": False},
    ),
    Case(
        "log_entry",
        closed(
            {
                "level": enum("DEBUG", "INFO", "WARNING", "ERROR"),
                "message": text(120),
                "date": DATE,
                "request_id": UUID,
                "context": closed({"service": text(30), "line": integer(1, 100000)}),
            }
        ),
        "Give a JSON object describing a log entry for a failed database connection.",
        {
            "level": "ERROR",
            "message": "connection refused",
            "date": "2024-01-15",
            "request_id": "0f8fad5b-d9cb-469f-a165-70867728950e",
            "context": {"service": "db", "line": 88},
        },
    ),
    Case(
        "http_request",
        closed(
            {
                "method": enum("GET", "POST", "PUT", "DELETE"),
                "path": {"type": "string", "pattern": "^/[a-z0-9/_-]{0,40}$"},
                "headers": {"type": "object", "additionalProperties": text(60), "maxProperties": 3},
                "body": {"anyOf": [{"type": "object"}, {"type": "null"}]},
            }
        ),
        "Give a JSON object describing an HTTP request that fetches a user's profile.",
        {"method": "GET", "path": "/users/42", "headers": {"Accept": "application/json"}, "body": None},
    ),
    Case(
        "git_commit",
        closed(
            {
                "sha": {"type": "string", "pattern": "^[0-9a-f]{7}$"},
                "author": text(40),
                "email": EMAIL,
                "message": text(72),
                "files_changed": integer(1, 1000),
            }
        ),
        "Give a JSON object describing a git commit that fixes a typo in the README.",
        {"sha": "3f9a2c1", "author": "Linus", "email": "linus@example.com", "message": "Fix typo", "files_changed": 1},
    ),
    Case(
        "quiz_question",
        closed({"question": text(120), "choices": array(text(40), 4, 4), "answer_index": integer(0, 3)}),
        "Give a JSON object describing a multiple-choice quiz question about geography.",
        {"question": "Capital of Italy?", "choices": ["Rome", "Milan", "Turin", "Naples"], "answer_index": 0},
    ),
    Case(
        "review_const",
        closed({"schema_version": {"const": 1}, "item": text(50), "stars": integer(1, 5), "comment": text(200)}),
        "Give a JSON object describing a short customer review of a coffee machine.",
        {"schema_version": 1, "item": "coffee machine", "stars": 4, "comment": "Good coffee."},
    ),
    Case(
        "nested_deep",
        closed(
            {
                "building": closed(
                    {
                        "name": text(30),
                        "floor": closed(
                            {"number": integer(0, 100), "room": closed({"number": text(6), "occupied": BOOLEAN})}
                        ),
                    }
                )
            }
        ),
        "Give a JSON object describing where an office is: building, floor and room.",
        {"building": {"name": "HQ", "floor": {"number": 3, "room": {"number": "301", "occupied": True}}}},
    ),
    Case(
        "all_optional",
        closed(
            {"nickname": text(20), "favorite_number": {"type": "integer"}, "likes_cats": BOOLEAN},
            optional=("nickname", "favorite_number", "likes_cats"),
        ),
        "Give a JSON object describing a few fun facts about yourself, any you like.",
        {},
    ),
    Case(
        "string_bounds",
        closed({"code": text(8, 4), "title": text(40, 10), "initials": text(3, 2)}),
        "Give a JSON object describing a conference talk: a short code, a title and the speaker's initials.",
        {"code": "T101", "title": "Fast decoding", "initials": "AB"},
    ),
    Case(
        "numeric_ranges",
        closed(
            {
                "percentage": {"type": "number", "minimum": 0, "exclusiveMaximum": 100},
                "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
                "correlation": number(-1, 1),
                "step": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
            }
        ),
        "Give a JSON object describing a sensor reading: a percentage, a level, a correlation and a step.",
        {"percentage": 42.5, "level": 3, "correlation": -0.2, "step": 25},
    ),
    Case(
        "soft_delete_null",
        closed({"id": integer(1, 1000000), "name": text(40), "deleted_at": {"type": "null"}}),
        "Give a JSON object describing a customer record that has not been deleted.",
        {"id": 7, "name": "Bob", "deleted_at": None},
    ),
    Case(
        "mixed_enum",
        closed({"setting": text(30), "value": enum("on", "off", 0, 1, None, True, False)}),
        "Give a JSON object describing the value of the 'autosave' setting.",
        {"setting": "autosave", "value": True},
    ),
    Case(
        "word_counts",
        closed(
            {
                "sentence": text(100),
                "counts": {"type": "object", "additionalProperties": integer(0, 100), "maxProperties": 4},
            }
        ),
        "Give a JSON object describing how often each word occurs in 'the cat saw the dog'.",
        {"sentence": "the cat saw the dog", "counts": {"the": 2, "cat": 1}},
    ),
    Case(
        # additionalProperties left unsaid, as non-strict clients send it: the engine admits the listed keys only
        "inventory_unsaid_additional",
        {
            "type": "object",
            "properties": {
                "warehouse": text(30),
                "items": array(closed({"sku": text(12), "count": integer(0, 9999)}), 1, 4),
            },
            "required": ["warehouse", "items"],
        },
        "Give a JSON object describing the inventory of a small warehouse.",
        {"warehouse": "North", "items": [{"sku": "A1", "count": 3}]},
    ),
    Case(
        "openai_person",
        openai_model(
            "Person",
            {
                "name": {"description": "Full name", "title": "Name", "type": "string"},
                "age": {"title": "Age", "type": "integer"},
                "favorite_color": {"$ref": "#/$defs/Color"},
                "home": {"$ref": "#/$defs/Address"},
                "work": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
            },
            {"Address": OPENAI_ADDRESS, "Color": OPENAI_COLOR},
        ),
        "Give a JSON object describing a person with their favorite color, home and work addresses.",
        {
            "name": "Ada Lovelace",
            "age": 36,
            "favorite_color": "green",
            "home": {"street": "1 Main St", "city": "London", "zip": None},
            "work": None,
        },
    ),
    Case(
        "openai_calendar_event",
        openai_model(
            "CalendarEvent",
            {
                "name": {"title": "Name", "type": "string"},
                "date": {"title": "Date", "type": "string"},
                "participants": {"items": {"type": "string"}, "title": "Participants", "type": "array"},
            },
        ),
        "Give a JSON object describing this event: Alice and Bob are going to a science fair on Friday.",
        {"name": "Science fair", "date": "Friday", "participants": ["Alice", "Bob"]},
    ),
    Case(
        "openai_math_reasoning",
        openai_model(
            "MathReasoning",
            {
                "steps": {"items": {"$ref": "#/$defs/Step"}, "title": "Steps", "type": "array"},
                "final_answer": {"title": "Final Answer", "type": "string"},
            },
            {"Step": OPENAI_STEP},
        ),
        "Give a JSON object describing how to solve 8x + 7 = -23, step by step.",
        {"steps": [{"explanation": "Subtract 7", "output": "8x = -30"}], "final_answer": "x = -3.75"},
    ),
    Case(
        "openai_entities",
        openai_model(
            "Entities",
            {
                "attributes": {"items": {"type": "string"}, "title": "Attributes", "type": "array"},
                "colors": {"items": {"type": "string"}, "title": "Colors", "type": "array"},
                "animals": {"items": {"type": "string"}, "title": "Animals", "type": "array"},
            },
        ),
        "Give a JSON object describing the entities in 'The quick brown fox jumps over the lazy dog'.",
        {"attributes": ["quick", "lazy"], "colors": ["brown"], "animals": ["fox", "dog"]},
    ),
    Case(
        "openai_order",
        openai_model(
            "Order",
            {
                "order_id": {"title": "Order Id", "type": "string"},
                "status": {"$ref": "#/$defs/OrderStatus"},
                "items": {"items": {"$ref": "#/$defs/LineItem"}, "title": "Items", "type": "array"},
                "shipping": {"anyOf": [{"$ref": "#/$defs/Address"}, {"type": "null"}]},
                "gift": {"title": "Gift", "type": "boolean"},
            },
            {"Address": OPENAI_ADDRESS, "LineItem": OPENAI_LINE_ITEM, "OrderStatus": OPENAI_ORDER_STATUS},
        ),
        "Give a JSON object describing an online order of two books that has shipped.",
        {
            "order_id": "A-1001",
            "status": "shipped",
            "items": [{"product": "Dune", "quantity": 2, "unit_price": 9.99}],
            "shipping": {"street": "5 Elm St", "city": "Boston", "zip": "02101"},
            "gift": False,
        },
    ),
    Case(
        "openai_moderation",
        openai_model(
            "ContentCompliance",
            {
                "is_violating": {"title": "Is Violating", "type": "boolean"},
                "category": {
                    "anyOf": [{"enum": ["violence", "sexual", "self_harm"], "type": "string"}, {"type": "null"}],
                    "title": "Category",
                },
                "explanation_if_violating": {
                    "anyOf": [{"type": "string"}, {"type": "null"}],
                    "title": "Explanation If Violating",
                },
            },
        ),
        "Give a JSON object describing whether the message 'How do I bake bread?' violates a content policy.",
        {"is_violating": False, "category": None, "explanation_if_violating": None},
    ),
    Case(
        "openai_research_paper",
        openai_model(
            "ResearchPaperExtraction",
            {
                "title": {"title": "Title", "type": "string"},
                "authors": {"items": {"type": "string"}, "title": "Authors", "type": "array"},
                "abstract": {"title": "Abstract", "type": "string"},
                "keywords": {"items": {"type": "string"}, "title": "Keywords", "type": "array"},
                "year": {"anyOf": [{"type": "integer"}, {"type": "null"}], "title": "Year"},
            },
        ),
        "Give a JSON object describing the paper 'Attention Is All You Need'.",
        {
            "title": "Attention Is All You Need",
            "authors": ["Vaswani"],
            "abstract": "Transformers.",
            "keywords": ["attention"],
            "year": 2017,
        },
    ),
    Case(
        "openai_ui_literal",
        openai_model(
            "Button",
            {
                "type": {"const": "button", "title": "Type", "type": "string"},
                "label": {"title": "Label", "type": "string"},
                "variant": {"enum": ["primary", "secondary", "danger"], "title": "Variant", "type": "string"},
                "disabled": {"title": "Disabled", "type": "boolean"},
            },
        ),
        "Give a JSON object describing a red 'Delete account' button in a settings page.",
        {"type": "button", "label": "Delete account", "variant": "danger", "disabled": False},
    ),
]
