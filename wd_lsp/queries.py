"""tree-sitter queries per grammar: definitions and imports.

Captures: `@definition` is the whole definition node, `@name` its name (both in the same
pattern, so a match pairs them); `@import` is the module/path text of an import.
Shaped after the grammars' own tags.scm files, trimmed to what completion context needs.
"""

from __future__ import annotations

_JS_DEFINITIONS = """
(function_declaration name: (identifier) @name) @definition
(generator_function_declaration name: (identifier) @name) @definition
(class_declaration name: (_) @name) @definition
(method_definition name: (property_identifier) @name) @definition
(lexical_declaration
  (variable_declarator
    name: (identifier) @name
    value: [(arrow_function) (function_expression) (class)])) @definition
(variable_declaration
  (variable_declarator
    name: (identifier) @name
    value: [(arrow_function) (function_expression) (class)])) @definition
"""

_TS_EXTRA_DEFINITIONS = """
(abstract_class_declaration name: (type_identifier) @name) @definition
(interface_declaration name: (type_identifier) @name) @definition
(type_alias_declaration name: (type_identifier) @name) @definition
(enum_declaration name: (identifier) @name) @definition
(function_signature name: (identifier) @name) @definition
"""

_JS_IMPORTS = """
(import_statement source: (string) @import)
(export_statement source: (string) @import)
(call_expression
  function: (identifier) @_require
  arguments: (arguments (string) @import))
"""

_C_DEFINITIONS = """
(function_definition
  declarator: [
    (function_declarator declarator: (identifier) @name)
    (pointer_declarator declarator: (function_declarator declarator: (identifier) @name))
  ]) @definition
(declaration
  declarator: [
    (function_declarator declarator: (identifier) @name)
    (pointer_declarator declarator: (function_declarator declarator: (identifier) @name))
  ]) @definition
(struct_specifier name: (type_identifier) @name body: (_)) @definition
(union_specifier name: (type_identifier) @name body: (_)) @definition
(enum_specifier name: (type_identifier) @name body: (_)) @definition
(type_definition declarator: (type_identifier) @name) @definition
(preproc_function_def name: (identifier) @name) @definition
(preproc_def name: (identifier) @name) @definition
"""

_CPP_EXTRA_DEFINITIONS = """
(function_definition
  declarator: (function_declarator
    declarator: [
      (field_identifier) @name
      (qualified_identifier name: (identifier) @name)
    ])) @definition
(function_definition
  declarator: (reference_declarator
    (function_declarator declarator: (_) @name))) @definition
(class_specifier name: (type_identifier) @name body: (_)) @definition
(alias_declaration name: (type_identifier) @name) @definition
"""

_C_IMPORTS = """
(preproc_include path: [(string_literal) (system_lib_string)] @import)
"""

DEFINITIONS: dict[str, str] = {
    "python": """
(function_definition name: (identifier) @name) @definition
(class_definition name: (identifier) @name) @definition
(module (expression_statement (assignment left: (identifier) @name)) @definition)
""",
    "javascript": _JS_DEFINITIONS,
    "typescript": _JS_DEFINITIONS + _TS_EXTRA_DEFINITIONS,
    "tsx": _JS_DEFINITIONS + _TS_EXTRA_DEFINITIONS,
    "go": """
(function_declaration name: (identifier) @name) @definition
(method_declaration name: (field_identifier) @name) @definition
(type_declaration (type_spec name: (type_identifier) @name)) @definition
(const_declaration (const_spec name: (identifier) @name)) @definition
""",
    "rust": """
(function_item name: (identifier) @name) @definition
(function_signature_item name: (identifier) @name) @definition
(struct_item name: (type_identifier) @name) @definition
(enum_item name: (type_identifier) @name) @definition
(union_item name: (type_identifier) @name) @definition
(trait_item name: (type_identifier) @name) @definition
(type_item name: (type_identifier) @name) @definition
(const_item name: (identifier) @name) @definition
(static_item name: (identifier) @name) @definition
(macro_definition name: (identifier) @name) @definition
""",
    "c": _C_DEFINITIONS,
    "cpp": _C_DEFINITIONS + _CPP_EXTRA_DEFINITIONS,
    "java": """
(class_declaration name: (identifier) @name) @definition
(interface_declaration name: (identifier) @name) @definition
(enum_declaration name: (identifier) @name) @definition
(record_declaration name: (identifier) @name) @definition
(method_declaration name: (identifier) @name) @definition
(constructor_declaration name: (identifier) @name) @definition
""",
}

IMPORTS: dict[str, str] = {
    "python": """
(import_statement name: [(dotted_name) (aliased_import name: (dotted_name))] @import)
(import_from_statement module_name: [(dotted_name) (relative_import)] @import)
""",
    "javascript": _JS_IMPORTS,
    "typescript": _JS_IMPORTS,
    "tsx": _JS_IMPORTS,
    "go": """
(import_spec path: (interpreted_string_literal) @import)
""",
    "rust": """
(use_declaration argument: (_) @import)
(mod_item name: (identifier) @import !body)
""",
    "c": _C_IMPORTS,
    "cpp": _C_IMPORTS,
    "java": """
(import_declaration [(scoped_identifier) (identifier)] @import)
""",
}
