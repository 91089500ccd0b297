// Package schemafile knows the schema files: the version of them the programs need, checked
// against the database at their start (version.go), and how to read schema.sql the way psql
// applies it, as one text that database/sql can Exec: every `\ir FILE` line (psql's
// \include_relative) is replaced by FILE's text, FILE taken beside the file that names it.
// The contract applies the schema with `psql -v ON_ERROR_STOP=1 -f schema.sql`; the tests,
// tools/faninbench and bench/pipeline apply it through a database connection instead, and use
// this package so that both ways run the same statements.
//
// Only \ir and \include_relative are understood. Any other line that starts with a backslash
// is an error, not passed on: the server would reject it with a syntax error far from its
// cause, and psql would run it with a meaning this package does not reproduce.
package schemafile

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// maxDepth bounds nested includes; a file that includes itself, directly or not, is an error
// long before it.
const maxDepth = 8

// Read returns the text of the SQL file at path with its includes expanded.
func Read(path string) (string, error) {
	var b strings.Builder
	if err := expand(&b, path, nil); err != nil {
		return "", err
	}
	return b.String(), nil
}

// expand writes path's text to b, expanding includes; stack holds the files being expanded.
func expand(b *strings.Builder, path string, stack []string) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return fmt.Errorf("read schema file %s: %w", path, err)
	}
	for _, p := range stack {
		if p == abs {
			return fmt.Errorf("read schema file %s: it includes itself (%s)", path, strings.Join(append(stack, abs), " -> "))
		}
	}
	if len(stack) >= maxDepth {
		return fmt.Errorf("read schema file %s: includes nested deeper than %d", path, maxDepth)
	}
	text, err := os.ReadFile(abs)
	if err != nil {
		return fmt.Errorf("read schema file: %w", err)
	}
	stack = append(stack, abs)
	for n, line := range strings.SplitAfter(string(text), "\n") {
		trimmed := strings.TrimSpace(line)
		if !strings.HasPrefix(trimmed, `\`) {
			b.WriteString(line)
			continue
		}
		name, ok := includeName(trimmed)
		if !ok {
			return fmt.Errorf("read schema file %s:%d: psql meta-command %q: only \\ir FILE is supported", path, n+1, trimmed)
		}
		if err := expand(b, filepath.Join(filepath.Dir(abs), name), stack); err != nil {
			return fmt.Errorf("%s:%d: %w", path, n+1, err)
		}
		b.WriteString("\n") // an included file without a final newline still ends its last statement's line
	}
	return nil
}

// includeName returns FILE of a line `\ir FILE` or `\include_relative FILE` (FILE optionally
// in single quotes, as psql allows), and false for any other line.
func includeName(line string) (string, bool) {
	cmd, arg, found := strings.Cut(line, " ")
	if !found || (cmd != `\ir` && cmd != `\include_relative`) {
		return "", false
	}
	arg = strings.TrimSpace(arg)
	if len(arg) >= 2 && arg[0] == '\'' && arg[len(arg)-1] == '\'' {
		arg = arg[1 : len(arg)-1]
	}
	if arg == "" || strings.ContainsAny(arg, " \t'\\") {
		return "", false
	}
	return arg, true
}
