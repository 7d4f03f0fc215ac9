"""Realistic (schema, document) pairs for the grammar benchmarks: what LLM structured output
tends to look like (profiles, orders, tool calls, logs, catalogs, extraction results)."""
from __future__ import annotations

ADDRESS = {"type": "object", "properties": {
    "street": {"type": "string"}, "city": {"type": "string"}, "postal_code": {"type": "string", "pattern": "[0-9]{5}"},
    "country": {"type": "string", "enum": ["FR", "DE", "US", "GB", "JP"]}},
    "required": ["street", "city", "country"]}

PROFILE = ({"type": "object", "properties": {
    "name": {"type": "string"}, "email": {"type": "string", "format": "email"},
    "age": {"type": "integer", "minimum": 0, "maximum": 150}, "address": ADDRESS,
    "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 5}, "verified": {"type": "boolean"}},
    "required": ["name", "email", "age", "address"]},
    {"name": "Marie-Hélène Dupont", "email": "mh.dupont@example.fr", "age": 42,
     "address": {"street": "12 rue des Lilas", "city": "Lyon", "postal_code": "69003", "country": "FR"},
     "languages": ["French", "English", "Italian"], "verified": True})

ORDER = ({"type": "object", "properties": {
    "order_id": {"type": "string", "pattern": "ORD-[0-9]{6}"},
    "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
    "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "description": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
        "unit_price": {"type": "number"}}, "required": ["sku", "quantity", "unit_price"]}},
    "total": {"type": "number"}, "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
    "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    "required": ["order_id", "status", "items", "total", "currency"]},
    {"order_id": "ORD-004211", "status": "shipped", "items": [
        {"sku": "KB-104-FR", "description": "Mechanical keyboard, AZERTY layout", "quantity": 1, "unit_price": 129.9},
        {"sku": "USB-C-2M", "description": "USB-C cable (2 m)", "quantity": 3, "unit_price": 9.99}],
     "total": 159.87, "currency": "EUR", "notes": None})

TOOL_CALL = ({"type": "object", "properties": {
    "name": {"const": "search_flights"}, "arguments": {"type": "object", "properties": {
        "origin": {"type": "string", "pattern": "[A-Z]{3}"}, "destination": {"type": "string", "pattern": "[A-Z]{3}"},
        "date": {"type": "string", "format": "date"}, "passengers": {"type": "integer", "minimum": 1},
        "cabin": {"enum": ["economy", "premium", "business", "first"]}, "flexible": {"type": "boolean"}},
        "required": ["origin", "destination", "date", "passengers"]}},
    "required": ["name", "arguments"]},
    {"name": "search_flights", "arguments": {"origin": "CDG", "destination": "NRT", "date": "2025-04-03",
                                             "passengers": 2, "cabin": "premium", "flexible": False}})

LOG_EVENTS = ({"type": "array", "items": {"type": "object", "properties": {
    "timestamp": {"type": "string", "format": "date-time"}, "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
    "service": {"type": "string"}, "message": {"type": "string"}, "latency_ms": {"type": "number"}},
    "required": ["timestamp", "level", "message"]}, "maxItems": 10},
    [{"timestamp": "2024-11-30T06:41:12Z", "level": "INFO", "service": "checkout",
      "message": "payment authorised for cart #88412", "latency_ms": 231.4},
     {"timestamp": "2024-11-30T06:41:13Z", "level": "WARN", "service": "inventory",
      "message": "stock below threshold: sku=KB-104-FR (3 left)", "latency_ms": 12.0},
     {"timestamp": "2024-11-30T06:41:15Z", "level": "ERROR", "service": "mailer",
      "message": "SMTP timeout after 30s; will retry (attempt 2/5)"}])

EXTRACTION = ({"type": "object", "properties": {
    "title": {"type": "string"}, "authors": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "affiliation": {"type": "string"}}, "required": ["name"]}},
    "year": {"type": "integer"}, "keywords": {"type": "array", "items": {"type": "string"}},
    "summary": {"type": "string"}, "sentiment": {"enum": ["positive", "neutral", "negative"]},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["title", "authors", "year", "summary", "sentiment", "confidence"]},
    {"title": "Grammar-Constrained Decoding for Structured Outputs",
     "authors": [{"name": "A. Turing", "affiliation": "University of Manchester"}, {"name": "G. Hopper"}],
     "year": 2024, "keywords": ["constrained decoding", "JSON Schema", "pushdown automata"],
     "summary": "The paper shows that token masks computed from a context-free grammar can be overlapped "
                "with the model's forward pass, so that structured generation costs almost nothing.",
     "sentiment": "positive", "confidence": 0.87})

CATALOG = ({"type": "object", "properties": {"products": {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "price": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "dimensions": {"type": "object", "properties": {"w": {"type": "number"}, "h": {"type": "number"},
                                                   "d": {"type": "number"}}, "required": ["w", "h", "d"]},
    "in_stock": {"type": "boolean"}}, "required": ["id", "name", "price", "in_stock"]}}}, "required": ["products"]},
    {"products": [
        {"id": 1001, "name": "Desk lamp", "price": 34.5, "tags": ["lighting", "office"],
         "dimensions": {"w": 15.0, "h": 45.5, "d": 15.0}, "in_stock": True},
        {"id": 1002, "name": "Ergonomic chair", "price": 289.0, "tags": ["furniture"], "in_stock": False},
        {"id": 1003, "name": "Monitor arm", "price": 79.99, "tags": [], "dimensions": {"w": 10, "h": 60, "d": 50},
         "in_stock": True}]})

DOCUMENTS = [PROFILE, ORDER, TOOL_CALL, LOG_EVENTS, EXTRACTION, CATALOG]
