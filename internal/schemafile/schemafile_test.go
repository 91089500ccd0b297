package schemafile

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func write(t *testing.T, dir, name, text string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestReadRepositorySchema: the repository's schema.sql expands to one text with no psql
// meta-command left, the core first and fan-in's objects after it.
func TestReadRepositorySchema(t *testing.T) {
	text, err := Read("../../schema.sql")
	if err != nil {
		t.Fatal(err)
	}
	for i, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), `\`) {
			t.Fatalf("line %d of the expansion is a meta-command: %q", i+1, line)
		}
	}
	core := strings.Index(text, "CREATE TABLE IF NOT EXISTS workqueue (")
	fanin := strings.Index(text, "CREATE FUNCTION fanin_flush(")
	if core < 0 || fanin < 0 || fanin < core {
		t.Fatalf("expansion lacks the core table (%d) or fanin_flush after it (%d)", core, fanin)
	}
}

// TestReadIncludes: \ir and \include_relative, quoted or not, resolve beside the including
// file (not the working directory), nested, in order.
func TestReadIncludes(t *testing.T) {
	dir := t.TempDir()
	top := write(t, dir, "top.sql", "SELECT 1;\n\\ir sub/a.sql\n  \\include_relative 'sub/b.sql'  \nSELECT 4;\n")
	write(t, dir, "sub/a.sql", "SELECT 2;\n\\ir c.sql\n")
	write(t, dir, "sub/c.sql", "SELECT 2.5;") // no final newline
	write(t, dir, "sub/b.sql", "SELECT 3;\n")
	got, err := Read(top)
	if err != nil {
		t.Fatal(err)
	}
	stmts := strings.Fields(strings.ReplaceAll(got, "SELECT", ""))
	if want := "1; 2; 2.5; 3; 4;"; strings.Join(stmts, " ") != want {
		t.Errorf("expansion %q: statements %v, want %s", got, stmts, want)
	}
}

// TestReadRefuses: what psql would do differently, or not at all, is an error naming the file
// and line.
func TestReadRefuses(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct{ file, text, want string }{
		{"set.sql", "SELECT 1;\n\\set x 1\n", `set.sql:2: psql meta-command "\\set x 1"`},
		{"abs.sql", "\\i /etc/passwd\n", `abs.sql:1: psql meta-command "\\i /etc/passwd"`},
		{"missing.sql", "\\ir nowhere.sql\n", "nowhere.sql: no such file"},
		{"spaces.sql", "\\ir two words.sql\n", "spaces.sql:1: psql meta-command"},
	} {
		if _, err := Read(write(t, dir, c.file, c.text)); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err %v, want one containing %q", c.file, err, c.want)
		}
	}
	loop := write(t, dir, "loop.sql", "\\ir loop2.sql\n")
	write(t, dir, "loop2.sql", "\\ir loop.sql\n")
	if _, err := Read(loop); err == nil || !strings.Contains(err.Error(), "includes itself") {
		t.Errorf("cycle: err %v, want 'includes itself'", err)
	}
}
