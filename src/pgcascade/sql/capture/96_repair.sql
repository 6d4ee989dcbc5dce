-- Repair through the cascade: a repair run on a node with nodes below it (a branch) does not
-- write its fix there; the root puts it into the set's queue as `pgcascade.repair` events, in
-- order with the other changes, and every node applies it as it applies the batch that holds it
-- (docs/pipeline.md, "repair"; apply side: sql/replica/94_repair.sql).
--
-- Event (ev_type 'pgcascade.repair', ev_extra1 = the table, format('%I.%I', schema, table)):
--   ev_data = {"keys": [key images], "rows": [row images]}: each key ends as the root has it,
--   its row (when the event carries one) updated or inserted, else deleted.  Images are JSON as
--   the capture writes them (json_image_expr), whatever the table's event format.  A fix of many
--   rows is several events of at most REPAIR_CHUNK_BYTES of row images each, each with its rows'
--   keys; the keys the root has no row of travel in the last.

-- pgcascade.emit_repair(queue, table, key_columns, keys) -> events emitted.
-- `keys`: a JSON array of objects {key column: value as text}; for each, the table's row of that
-- key as it is now, or none (the subscribers delete theirs).  The caller holds a SHARE lock on
-- the table, so no write can come between the rows read here and the events.  Emitted with
-- emit_event: with logical capture the events travel through the WAL and keep their place.
create or replace function pgcascade.emit_repair(i_queue text, i_table regclass, i_keys text[], i_keyvals json)
returns int4
language plpgsql
set datestyle = 'ISO, MDY' set intervalstyle = postgres set extra_float_digits = 3 set bytea_output = hex
as $$
declare
    chunk_bytes constant int4 := 4 * 1024 * 1024;  -- REPAIR_CHUNK_BYTES
    v_name text;
    v_coldefs text;
    v_match text;
    v_tkeys text;
    v_found int4;
    v_absent text;
    v_rows text := '';
    v_keys text := '';
    v_events int4 := 0;
    r record;
begin
    select format('%I.%I', n.nspname, c.relname) into v_name
      from pg_class c join pg_namespace n on n.oid = c.relnamespace where c.oid = i_table;
    select string_agg(format('%I %s', a.attname, format_type(a.atttypid, a.atttypmod)), ', ' order by k.n),
           string_agg(format('t.%I = k.%I', a.attname, a.attname), ' and ' order by k.n),
           string_agg(format('t.%I', a.attname), ', ' order by k.n),
           count(*)
      into v_coldefs, v_match, v_tkeys, v_found
      from unnest(i_keys) with ordinality k(col, n)
      join pg_attribute a on a.attrelid = i_table and a.attname = k.col and a.attnum > 0 and not a.attisdropped;
    if v_found <> cardinality(i_keys) then
        raise exception 'table % has no key columns %', i_table, i_keys using errcode = '22023';
    end if;
    -- keys travel as typed images (every node reads them with its own column types): each with
    -- its row, and those the table does not have in the last event
    execute format('select string_agg(row_to_json(k)::text, '','') from json_to_recordset($1) as k(%s)'
                   ' where not exists (select 1 from %s t where %s)', v_coldefs, i_table, v_match)
       into v_absent using i_keyvals;
    for r in execute format('select %s as img, row_to_json((select x from (select %s) x))::text as key from %s t'
                            ' where exists (select 1 from json_to_recordset($1) as k(%s) where %s)',
                            pgcascade.json_image_expr('t', i_table), v_tkeys, i_table, v_coldefs, v_match)
               using i_keyvals loop
        if v_rows <> '' and length(v_rows) + length(r.img) > chunk_bytes then
            perform pgcascade.emit_event(i_queue, 'pgcascade.repair',
                                         format('{"keys":[%s],"rows":[%s]}', v_keys, v_rows), v_name);
            v_events := v_events + 1;
            v_rows := '';
            v_keys := '';
        end if;
        v_rows := v_rows || case when v_rows = '' then '' else ',' end || r.img;
        v_keys := v_keys || case when v_keys = '' then '' else ',' end || r.key;
    end loop;
    v_keys := concat_ws(',', nullif(v_keys, ''), v_absent);
    perform pgcascade.emit_event(i_queue, 'pgcascade.repair', format('{"keys":[%s],"rows":[%s]}', v_keys, v_rows),
                                 v_name);
    return v_events + 1;
end $$;
