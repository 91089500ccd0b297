// reference_tools_test.go: finding the real programs the tests hold pepsi against.

package main

import (
	"fmt"
	"os"
	"os/exec"
	"testing"
)

// referenceTool finds a program a test checks pepsi against (Debian's poolcounterd, its
// promtool, Chromium): the path in the environment variable env if set, else name on the
// PATH, else the first of also that exists. Missing, a test that cannot run without it is
// fatal in CI (.ci/run installs each) and a loud skip elsewhere, saying what did not run and
// how to get the program.
func referenceTool(t *testing.T, env, name, checks, install string, also ...string) string {
	t.Helper()
	path := ""
	if env != "" {
		path = os.Getenv(env)
	}
	if path == "" {
		path, _ = exec.LookPath(name)
	}
	for _, p := range also {
		if path != "" {
			break
		}
		if _, err := os.Stat(p); err == nil {
			path = p
		}
	}
	if path == "" {
		msg := fmt.Sprintf("%s not found: %s did NOT run; install it with `%s`", name, checks, install)
		if env != "" {
			msg += " or set " + env
		}
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		fmt.Fprintln(os.Stderr, "WARNING: "+msg)
		t.Skip(msg)
	}
	return path
}
