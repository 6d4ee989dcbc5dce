-- JSON null in json/jsonb columns.  row_to_json writes both an SQL NULL and a json/jsonb value
-- 'null' as `null`, and json_populate_record reads `null` back as SQL NULL.  So a row image
-- whose json/jsonb columns hold a JSON null also names them, under a key no column can have
-- (names are at most 63 bytes), and pgcascade.event_row reads such an image back exactly.
-- The apply uses event_row only for tables with json/jsonb columns; an image without that
-- key goes straight to json_populate_record.

create or replace function pgcascade.json_null_key() returns text
language sql immutable as $$ select 'pgcascade: the columns listed here hold a JSON null, not an SQL NULL'::pg_catalog.text $$;

-- pgcascade.base_type(type) -> the type itself, or a domain's base type.
create or replace function pgcascade.base_type(i_type oid) returns regtype
language sql stable as $$
    with recursive d(t) as (
        select i_type
        union all
        select p.typbasetype from pg_type p join d on p.oid = d.t where p.typtype = 'd')
    select d.t::regtype from d join pg_type p on p.oid = d.t where p.typtype <> 'd'
$$;

-- pgcascade.json_columns(table) -> its columns of type json or jsonb (or domains over them).
create or replace function pgcascade.json_columns(i_table regclass, out col text, out base regtype)
returns setof record
language sql stable as $$
    select a.attname::text, pgcascade.base_type(a.atttypid)
      from pg_attribute a
     where a.attrelid = i_table and a.attnum > 0 and not a.attisdropped
       and pgcascade.base_type(a.atttypid) in ('json'::regtype, 'jsonb'::regtype)
     order by a.attnum
$$;

-- pgcascade.mark_json_nulls(image, columns) -> the image, with the non-null names among
-- `columns` under json_null_key() when there are any.  Every name qualified: the capture
-- functions call it with their caller's search_path (90_capture.sql).
create or replace function pgcascade.mark_json_nulls(i_image text, i_cols text[]) returns text
language sql stable as $$
    select case when pg_catalog.array_remove(i_cols, null) OPERATOR(pg_catalog.=) '{}' then i_image
                else pg_catalog.left(i_image, -1) OPERATOR(pg_catalog.||) ','
                     OPERATOR(pg_catalog.||) pg_catalog.to_json(pgcascade.json_null_key())::pg_catalog.text
                     OPERATOR(pg_catalog.||) ':'
                     OPERATOR(pg_catalog.||) pg_catalog.to_json(pg_catalog.array_remove(i_cols, null))::pg_catalog.text
                     OPERATOR(pg_catalog.||) '}' end
$$;

-- pgcascade.json_image_expr(alias, columns, types) -> the SQL expression of the JSON image of row
-- `alias` with these columns of these types, as capture writes it (triggers and logical capture
-- alike).  From the columns, not a table: the capture daemon may read rows of a table that DDL
-- has dropped or changed since.  Every name in it qualified (the capture functions run with
-- their caller's search_path).
create or replace function pgcascade.json_image_expr(i_alias text, i_cols text[], i_types oid[]) returns text
language sql stable as $$
    select case when count(*) = 0 then format('pg_catalog.row_to_json(%s.*)::pg_catalog.text', i_alias)
                else format('pgcascade.mark_json_nulls(pg_catalog.row_to_json(%s.*)::pg_catalog.text, array[%s])', i_alias,
                            string_agg(format('case when pg_catalog.%s(%s.%I::pg_catalog.%s) OPERATOR(pg_catalog.=) ''null'' then %L end',
                                              case when j.base = 'jsonb'::regtype then 'jsonb_typeof' else 'json_typeof' end,
                                              i_alias, j.col, j.base, j.col), ', ' order by j.n))
           end
      from (select c.col, pgcascade.base_type(c.t) as base, c.n
              from unnest(i_cols, i_types) with ordinality c(col, t, n)) j
     where j.base in ('json'::regtype, 'jsonb'::regtype)
$$;

-- pgcascade.json_image_expr(alias, table) -> the same, of a row of `table`.
create or replace function pgcascade.json_image_expr(i_alias text, i_table regclass) returns text
language sql stable as $$
    select pgcascade.json_image_expr(i_alias, array_agg(a.attname::text order by a.attnum),
                                     array_agg(a.atttypid order by a.attnum))
      from pg_attribute a
     where a.attrelid = i_table and a.attnum > 0 and not a.attisdropped
$$;

-- pgcascade.event_row(null::T, image) -> the row of type T the JSON image holds, with JSON
-- nulls where the image lists them.
create or replace function pgcascade.event_row(i_base anyelement, i_data text) returns anyelement
language plpgsql stable as $$
declare
    v_nulls text[];
    v_fields text;
    v_rest json;
    v_row alias for $0;  -- the result, of the actual type of i_base
begin
    if strpos(i_data, pgcascade.json_null_key()) = 0 then
        return json_populate_record(i_base, i_data::json);
    end if;
    v_nulls := array(select json_array_elements_text(i_data::json -> pgcascade.json_null_key()));
    -- the listed columns as JSON null in a record literal (a json column keeps its text,
    -- spaces included), every other field null ...
    select '(' || string_agg(case when a.attname = any(v_nulls) then '"' || e.value::text || '"' else '' end,
                             ',' order by a.attnum) || ')'
      into v_fields
      from pg_attribute a join pg_type t on t.typrelid = a.attrelid
      left join json_each(i_data::json) e on e.key = a.attname
     where t.oid = pg_typeof(i_base) and a.attnum > 0 and not a.attisdropped;
    -- ... then filled from the image's other keys (json_each keeps each value's text)
    select coalesce(json_object_agg(e.key, e.value), '{}') into v_rest
      from json_each(i_data::json) e where e.key <> all(v_nulls) and e.key <> pgcascade.json_null_key();
    execute format('select * from json_populate_record(%L::%s, $1)', v_fields, pg_typeof(i_base))
       into v_row using v_rest;
    return v_row;
end $$;
