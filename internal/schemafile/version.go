package schemafile

import (
	"context"
	"database/sql"
	"fmt"
)

// Version is the schema version this module's programs need: what schema.sql's last
// statement, pepsi_schema_version(), returns once the file is applied. It is raised with every
// change to schema.sql, fanin.sql or operate.sql, which TestSchemaVersion holds to their text,
// so that a program upgraded without its schema says so at its start, instead of failing
// statement by statement ("column w.key_parked does not exist" at every claim).
const Version = 5

// Apply is what to do about a schema that is missing or older.
const Apply = `psql -v ON_ERROR_STOP=1 -f schema.sql "$DSN"`

// CheckVersion reads the version of the schema in the connection's search_path and refuses
// one older than Version, or one from before versions. A newer one is taken, and returned
// for the caller to say so: a schema only adds what a newer version needs, but a program
// rolled back under a schema a newer one applied may meet what it does not know.
func CheckVersion(ctx context.Context, q interface {
	QueryRowContext(context.Context, string, ...any) *sql.Row
}) (have int, err error) {
	var table, found bool
	var path string
	if err := q.QueryRowContext(ctx, `SELECT to_regclass('workqueue') IS NOT NULL,
	        to_regprocedure('pepsi_schema_version()') IS NOT NULL, current_setting('search_path')`).Scan(&table, &found, &path); err != nil {
		return 0, fmt.Errorf("check schema version: %w", err)
	}
	if !table {
		// Not an older schema: none here, or another schema than the DSN selects.
		return 0, fmt.Errorf("check schema: no workqueue table in the search_path of this connection (%s): "+
			"select the system's schema in the DSN (options='-c search_path=NAME'), or apply the schema: %s", path, Apply)
	}
	if found { // else from before versions: 0
		if err := q.QueryRowContext(ctx, `SELECT pepsi_schema_version()`).Scan(&have); err != nil {
			return 0, fmt.Errorf("check schema version: %w", err)
		}
	}
	if have < Version {
		what := fmt.Sprintf("version %d", have)
		if !found {
			what = "from before versions"
		}
		return have, fmt.Errorf("check schema version: the schema in the database is %s, older than this program, which needs version %d; "+
			"apply this version's schema.sql (it keeps every row): %s", what, Version, Apply)
	}
	return have, nil
}
