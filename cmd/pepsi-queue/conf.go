// conf.go: what pepsi-queue reads from the daemon's configuration file: the [database] DSN
// and the names of the file's stages (so that `pause` refuses a misspelt one). The file is
// read with the same rules as the daemon's (pepsi.conf(5)); other keys are not checked here.

package main

import (
	"bufio"
	"fmt"
	"os"
	"strings"
)

type confFile struct {
	path   string
	dsn    string
	stages map[string]bool
}

// readConf reads path; a missing file returns an empty confFile and an error wrapping
// os.ErrNotExist (PEPSI_DSN may stand in for it).
func readConf(path string) (*confFile, error) {
	c := &confFile{stages: map[string]bool{}}
	f, err := os.Open(path)
	if err != nil {
		return c, fmt.Errorf("read configuration: %w", err)
	}
	defer f.Close()
	c.path = path
	section := ""
	sc := bufio.NewScanner(f)
	line := 0
	for sc.Scan() {
		line++
		l := strings.TrimSpace(sc.Text())
		switch {
		case l == "" || l[0] == '#' || l[0] == ';':
		case l[0] == '[':
			if !strings.HasSuffix(l, "]") {
				return c, &usageError{fmt.Sprintf("%s:%d: section header without ]", path, line)}
			}
			section = strings.TrimSpace(l[1 : len(l)-1])
			if name, ok := strings.CutPrefix(section, "stage-"); ok {
				c.stages[name] = true
			}
		default:
			k, v, ok := strings.Cut(l, "=")
			if !ok {
				return c, &usageError{fmt.Sprintf("%s:%d: want KEY = value", path, line)}
			}
			if section == "database" && strings.TrimSpace(k) == "DSN" {
				c.dsn = strings.TrimSpace(v)
			}
		}
	}
	if err := sc.Err(); err != nil {
		return c, fmt.Errorf("read %s: %w", path, err)
	}
	return c, nil
}
