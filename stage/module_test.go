// module_test.go: the SDK used from a stage author's own module, as the package documentation
// says to (its module path, pepsi-dispatch, is no address the go command can fetch).

package stage

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestOwnModule: a module of its own that requires pepsi-dispatch through a replace directive
// pointing at a checkout builds, and the program it makes serves a message.
func TestOwnModule(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a module: not in -short")
	}
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	rel, err := filepath.Rel(dir, root) // as the documentation's ../pepsi-dispatch
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{
		"go.mod": fmt.Sprintf("module example.com/wordcount\n\ngo 1.23\n\nrequire pepsi-dispatch v0.0.0\n\nreplace pepsi-dispatch => %s\n", rel),
		"main.go": `package main

import (
	"context"

	"pepsi-dispatch/stage"
)

func main() {
	stage.Run(func(ctx context.Context, m *stage.Message) error {
		m.State["counted"] = true
		return m.Advance("b")
	})
}
`,
	}
	// The repository's checksums: tidy then asks no checksum database for lib/pq.
	sums, err := os.ReadFile(filepath.Join(root, "go.sum"))
	if err != nil {
		t.Fatal(err)
	}
	files["go.sum"] = string(sums)
	for name, text := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	gocmd := filepath.Join(runtime.GOROOT(), "bin", "go")
	for _, args := range [][]string{{"mod", "tidy"}, {"build", "-o", "wordcount", "."}} {
		cmd := exec.Command(gocmd, args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go %s in a module of its own: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	sch := newSchema(t)
	id := sch.put(t, "a", "running", `{}`)
	cmd := exec.Command(filepath.Join(dir, "wordcount"), "worker")
	cmd.Env = append(os.Environ(), "PEPSI_STAGE=a", "PEPSI_NEXT=b", "PEPSI_DSN="+sch.dsn)
	cmd.Stdin = strings.NewReader(fmt.Sprintf("%d\n", id))
	out, err := cmd.Output()
	if err != nil || string(out) != "0\n" {
		t.Fatalf("the module's stage program: %v, stdout %q", err, out)
	}
	if stage, _, state := sch.rowOf(t, id); stage != "b" || !strings.Contains(state, `"counted": true`) {
		t.Errorf("row %d: stage %s state %s, want advanced to b, counted", id, stage, state)
	}
}
