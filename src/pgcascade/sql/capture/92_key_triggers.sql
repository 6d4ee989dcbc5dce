-- The key-change row triggers: the capture's (_pgcascade_capture_key, 90_capture.sql: the D of
-- a row's old key) and a two-way master's (_pgcascade_tombstone_key, 93_two_way.sql).  Each
-- fires only WHEN a key column differs, but PostgreSQL reads and compiles that condition again
-- at every UPDATE statement of the table, ~15,000 instructions of the writer's backend a
-- statement whether it changes a key or not (bench/capture_cpu.py --callgrind: 450k -> 410k a
-- TPC-B transaction over no capture).  Made `AFTER UPDATE OF <key columns>`, the trigger is
-- skipped before its condition when the statement's SET list names no key column.
--
-- PostgreSQL decides that from the SET list, not from the row: a BEFORE UPDATE row trigger may
-- change a key the UPDATE does not name, and a column-specific trigger would not see it (its
-- old key would stay on the subscribers).  So a table with any BEFORE UPDATE row trigger that
-- is not pgcascade's, enabled or not, gets them without the column list.  The form follows the
-- table's triggers: chosen when the triggers are made, and made again when it no longer fits -
-- by the ticker's maintenance (maint_key_triggers, every maint_period), by `execute` after its
-- script, and, where auto DDL's event triggers are installed, by the CREATE TRIGGER itself, in
-- its transaction (docs/ddl.md).

-- pgcascade.key_triggers_column_specific(table) -> whether the table's key-change triggers may
-- name the key columns: it has no BEFORE UPDATE row trigger of another than pgcascade.
create or replace function pgcascade.key_triggers_column_specific(i_table regclass) returns bool
language sql stable as $$
    -- tgtype: ROW 1, BEFORE 2, UPDATE 16 (pg_trigger.h)
    select not exists (select 1 from pg_catalog.pg_trigger t join pg_catalog.pg_proc p on p.oid = t.tgfoid
                        where t.tgrelid = i_table and t.tgtype & 19 = 19
                          and p.pronamespace <> 'pgcascade'::regnamespace)
$$;

-- pgcascade.key_trigger_make(name, table, key_columns, condition_format, function) -> void: a
-- key-change trigger, made (again) in the form that fits the table: CREATE OR REPLACE on 14+,
-- where replacing one takes no ACCESS EXCLUSIVE lock.  condition_format: format() of one key
-- column's test, given the column's name twice; the tests are or-ed.
create or replace function pgcascade.key_trigger_make(i_name text, i_table regclass, i_keys text[], i_test text,
                                                      i_function text) returns void
language plpgsql as $$
declare
    v_replace bool := current_setting('server_version_num')::int >= 140000;
begin
    if not v_replace then
        execute format('drop trigger if exists %I on %s', i_name, i_table);
    end if;
    execute format('create %s trigger %I after update%s on %s for each row when (%s) execute function %s',
                   case when v_replace then 'or replace' end, i_name,
                   case when pgcascade.key_triggers_column_specific(i_table)
                        then ' of ' || array_to_string(array(select quote_ident(k) from unnest(i_keys) k), ', ') end,
                   i_table, array_to_string(array(select format(i_test, k, k) from unnest(i_keys) k), ' or '),
                   i_function);
end $$;

-- pgcascade.capture_key_trigger(table, key_columns) -> void: the row trigger that captures the
-- old key of a row whose key an UPDATE changed.  Its condition names the key columns, so
-- PostgreSQL refuses to change their type while it is there (`execute` takes it off and puts
-- it back around such a script: cli/tables.py).  Keys are NOT NULL: <> suffices.
create or replace function pgcascade.capture_key_trigger(i_table regclass, i_keys text[]) returns void
language sql as $$
    select pgcascade.key_trigger_make('_pgcascade_capture_key', i_table, i_keys, 'old.%I OPERATOR(pg_catalog.<>) new.%I',
                                      format('pgcascade.%I()', 'capture_' || i_table::oid || '_key'))
$$;

-- pgcascade.capture_key_triggers_lift(queue) -> the set tables whose key trigger it dropped, for
-- a script that changes a key column's type; capture_key_triggers_restore(queue, tables) puts
-- them back in the same transaction.  DROP TRIGGER locks each table ACCESS EXCLUSIVE until then.
create or replace function pgcascade.capture_key_triggers_lift(i_queue text) returns text[]
language plpgsql as $$
declare
    lifted text[] := '{}';
    t record;
begin
    for t in select st.table_name from pgcascade.set_table st
              where st.queue_name = i_queue and to_regclass(st.table_name) is not null
                and exists (select 1 from pg_trigger where tgrelid = to_regclass(st.table_name)
                                                       and tgname = '_pgcascade_capture_key')
              order by st.table_name
    loop
        execute format('drop trigger _pgcascade_capture_key on %s', t.table_name);
        lifted := lifted || t.table_name;
    end loop;
    return lifted;
end $$;

create or replace function pgcascade.capture_key_triggers_restore(i_queue text, i_tables text[]) returns void
language sql as $$
    select pgcascade.capture_key_trigger(st.table_name::regclass, st.key_columns)
      from pgcascade.set_table st
     where st.queue_name = i_queue and st.table_name = any(i_tables) and to_regclass(st.table_name) is not null
$$;

-- pgcascade.key_triggers_fit(table, key_columns) -> whether it made the table's key-change
-- triggers again, in the form that fits its triggers now; each keeps the firing state it had
-- (a two-way master's fire ALWAYS).
create or replace function pgcascade.key_triggers_fit(i_table regclass, i_keys text[]) returns bool
language plpgsql as $$
declare
    v_specific bool := pgcascade.key_triggers_column_specific(i_table);
    v_made bool := false;
    t record;
begin
    for t in select tgname, tgenabled from pg_trigger
              where tgrelid = i_table and tgname in ('_pgcascade_capture_key', '_pgcascade_tombstone_key')
                and (cardinality(tgattr::int2[]) > 0) <> v_specific
    loop
        if t.tgname = '_pgcascade_capture_key' then
            perform pgcascade.capture_key_trigger(i_table, i_keys);
        else
            perform pgcascade.tombstone_key_trigger(i_table, i_keys);  -- 93_two_way.sql
        end if;
        if t.tgenabled <> 'O' then
            execute format('alter table %s %s trigger %I', i_table,
                           case t.tgenabled when 'A' then 'enable always' when 'R' then 'enable replica'
                                else 'disable' end, t.tgname);
        end if;
        v_made := true;
    end loop;
    return v_made;
end $$;

-- pgcascade.maint_key_triggers(queue) -> tables whose key-change triggers it made again: the
-- ticker's maintenance.  A table whose lock does not come within 200 ms is left for the next round.
create or replace function pgcascade.maint_key_triggers(i_queue text) returns int4
language plpgsql as $$
declare
    t record;
    n int4 := 0;
    v_old_timeout text := current_setting('lock_timeout');
begin
    perform set_config('lock_timeout', '200ms', true);
    for t in select to_regclass(st.table_name) as rel, st.key_columns from pgcascade.set_table st
              where st.queue_name = i_queue
                and exists (select 1 from pg_trigger where tgrelid = to_regclass(st.table_name)
                               and tgname in ('_pgcascade_capture_key', '_pgcascade_tombstone_key'))
              order by st.table_name
    loop
        begin
            n := n + pgcascade.key_triggers_fit(t.rel, t.key_columns)::int;
        exception when lock_not_available then
            null;  -- the next round
        end;
    end loop;
    perform set_config('lock_timeout', v_old_timeout, true);
    return n;
end $$;
